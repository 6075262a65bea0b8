"""`gymv cluster`: a Ray cluster on a SLURM allocation (`up`), and the batch script that asks for one (`sbatch`)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from gymv_cli.output import err_console

app = typer.Typer(
    help="Run gymv on a SLURM allocation: a Ray head and workers on its nodes, then the command.\n\n"
         "Example: gymv cluster sbatch recipes/llm/grpo-qwen3-8b-2n8g-megatron-tp2.yaml --time 4:00:00 --write job.sh",
    no_args_is_help=True,
)


@app.command("up", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up(
    ctx: typer.Context,
    port: int = typer.Option(6379, "--port", help="The Ray head's port."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds for every node to join (then an error)."),
    num_cpus: int = typer.Option(None, "--num-cpus", help="CPUs each Ray node offers (default: what Ray detects)."),
    num_gpus: int = typer.Option(None, "--num-gpus", help="GPUs each Ray node offers (default: what Ray detects)."),
    gpus_per_node: int = typer.Option(0, "--gpus-per-node", help="GPUs each node's srun step holds (--gpus-per-node)."),
) -> None:
    """Start Ray on every node of this SLURM allocation, run COMMAND with RAY_ADDRESS set, stop Ray.

    The first node is the head; node i is labelled gymv-node=i (pin roles with cluster.placement.<role>.labels).
    The cluster uses Ray's token authentication (a token is made for the job unless RAY_AUTH_TOKEN is set).
    Outside an allocation COMMAND runs as it is, so drivers may always go through it. Exit code: COMMAND's.

    Example: gymv cluster up -- gymv train recipes/llm/grpo-qwen3-8b-2n8g-megatron-tp2.yaml
    """
    from gymv.cluster.slurm import cluster_up

    say = lambda text: err_console.print(text, markup=False, highlight=False)  # noqa: E731
    code = cluster_up(list(ctx.args), port=port, timeout_s=timeout, num_cpus=num_cpus, num_gpus=num_gpus,
                      gpus_per_node=gpus_per_node, say=say)
    raise typer.Exit(code)


@app.command("sbatch")
def sbatch(
    recipe: Path = typer.Argument(..., help="Recipe YAML (its cluster.num_nodes and gpus_per_node size the job), or "
                                            "a test-suite driver .sh (its CONFIG block does)."),
    overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Recipe overrides, passed to gymv train "
                                          "(or to the driver).", show_default=False),
    time: str = typer.Option(None, "--time", help="SLURM time limit, e.g. 4:00:00."),
    account: str = typer.Option(None, "--account", help="SLURM account."),
    partition: str = typer.Option(None, "--partition", help="SLURM partition."),
    output: str = typer.Option(None, "--output", help="SLURM log file, e.g. logs/%j.out."),
    write: Path = typer.Option(None, "--write", help="Write the script here instead of printing it."),
    port: int = typer.Option(6379, "--port", help="The Ray head's port in the allocation."),
) -> None:
    """Print (or --write) a SLURM batch script that runs `gymv train RECIPE` on the nodes and GPUs the recipe asks for.

    The script asks for cluster.num_nodes nodes with cluster.gpus_per_node GPUs each, then runs `gymv cluster
    up -- gymv train RECIPE [KEY=VALUE]...` in the allocation. Given a driver (recipes/drivers/...sh), it asks
    for the driver's NUM_NODES x GPUS_PER_NODE for NUM_MINUTES, what `gymv dry-run` counts for one of its
    runs, and runs the driver (which goes through `gymv cluster up`). Submit it with sbatch.

    Example: gymv cluster sbatch recipes/llm/grpo-qwen3-8b-2n8g-megatron-tp2.yaml --time 4:00:00 --account me --write job.sh
    """
    from gymv.cluster.slurm import BatchJob, check_write_target
    from gymv.io import atomic_write_text

    if write is not None:
        check_write_target(write)
    overrides = list(overrides or [])
    where = dict(time=time, account=account, partition=partition, output=output, workdir=str(Path.cwd()), port=port)
    if recipe.suffix == ".sh":
        job = BatchJob.for_driver(recipe, overrides, **where)
    else:
        from gymv.config import load_recipe

        cfg = load_recipe(recipe, overrides).validated
        command = (sys.executable, "-m", "gymv_cli.main", "train", str(recipe.resolve()), *overrides)
        job = BatchJob(cfg.cluster.num_nodes, cfg.cluster.gpus_per_node, command, cfg.name or recipe.stem,
                       job_name_from="name" if cfg.name else str(recipe), **where)
    if write is None:
        sys.stdout.write(job.script())
        return
    atomic_write_text(write, job.script())
    if write.is_file():  # not a device written into (/dev/stdout)
        write.chmod(0o755)
    err_console.print(f"wrote {write}: {job.nodes} node(s) x {job.gpus_per_node} GPU(s); submit with: sbatch {write}",
                      markup=False, highlight=False)
