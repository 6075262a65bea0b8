"""Small builders the training loops share: where the policy starts, the run directory, the worker spec,
sampling parameters and per-step seeds.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gymv.backends.generation import SamplingParams
from gymv.cluster.placement_record import placement_lines, placement_record, write_placement
from gymv.cluster.ray_placement import ROSTER
from gymv.config.schema import RecipeBase
from gymv.errors import GymvError
from gymv.models.init_path import resolve_init_path  # noqa: F401  (train and tests import it here)
from gymv.models.load import checkpoint_dtype
from gymv.runs.checkpoint import find_latest
from gymv.runs.config_history import CHANGES_FILE, LAUNCH_KEYS, describe, diff
from gymv.runs.run_dir import RunDir, run_path
from gymv.train.data import DATA_DIR, Row

# the workers (torch) load where the spec is built: gymv.train's pre-flight imports this module first
if TYPE_CHECKING:
    from gymv.cluster.workers import WorkerSpec


class Reporter:
    """What a loop tells its caller (the CLI renders it; tests listen). Every hook is optional."""

    def on_run(self, run_dir: Path) -> None:
        """The run directory is open (before Ray starts): where an interrupted run resumes from."""

    def on_start(self, info: dict) -> None: ...

    def on_message(self, text: str) -> None: ...

    def on_step(self, step: int, metrics: dict) -> None: ...

    def on_phase(self, step: int, name: str) -> None:
        """A phase of step `step` starts (generation, training, refit, validation, checkpoint, ...)."""

    def on_refit(self, step: int, cluster: Any) -> None: ...

    def on_checkpoint(self, step: int, path: Path) -> None: ...


@dataclass
class RunContext:
    """A run ready to train: its validated config, directory, data and where the policy starts."""

    cfg: RecipeBase
    run: RunDir
    model_path: str
    train_rows: list[Row]
    eval_rows: list[Row]
    ray_address: str | None = None
    reporter: Reporter = field(default_factory=Reporter)
    train_source: str | None = None  # the rows' file, when there is one, for "FILE line N" in errors
    eval_source: str | None = None
    checked: Any = None  # what the pre-flight checked the recipe against (gymv.cluster.preflight.Checked)


# ------------------------------------------------------------------------------------------ model path


def generation_dtype(cfg: RecipeBase, model_path: str) -> str:
    """`model.dtype`, where auto is the checkpoint's dtype on GPU and float32 on CPU."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    if cfg.cluster.gpus_per_node == 0:
        return "float32"
    text = checkpoint_dtype(model_path)
    return text if text in ("float32", "bfloat16", "float16") else "float32"


# ------------------------------------------------------------------------------------------ run directory


def open_run(cfg: RecipeBase, config_dict: dict, resume_dir: str | None) -> tuple[RunDir, bool]:
    """(the run directory, whether to resume from it). `--resume DIR` names it; else `<checkpoint.dir>/<name>`."""
    if resume_dir is not None:
        path = Path(resume_dir).absolute()
        if not path.is_dir():
            raise GymvError("run directory not found", where=str(path), fix="pass the runs/<name> folder of an earlier run")
        if not (path / "config.yaml").exists():
            raise GymvError("not a gymv run directory (no config.yaml)", where=str(path),
                            fix="pass the runs/<name> folder of an earlier `gymv train`")
        return RunDir.create(path, config_dict, resume=True), True
    path = run_path(cfg.checkpoint.dir, cfg.name).absolute()  # workers write checkpoints into it, from anywhere
    if (path / "config.yaml").exists():
        if not _has_trained(RunDir(path)):
            _forget_unstarted(path)
        elif cfg.checkpoint.resume:
            refuse_changed_config(RunDir(path), config_dict)
    return RunDir.create(path, config_dict, resume=cfg.checkpoint.resume), cfg.checkpoint.resume


def _forget_unstarted(path: Path) -> None:
    """A launch that stopped before its first step (a typo in a data path, a row too long) left a config and
    maybe prepared rows, and no weights: the next launch starts afresh there, its config recorded as the
    run's own (not as a change of the broken one), its rows prepared from its own config."""
    for name in ("config.yaml", CHANGES_FILE, "metrics.jsonl"):
        (path / name).unlink(missing_ok=True)
    shutil.rmtree(path / DATA_DIR, ignore_errors=True)


def _has_trained(run: RunDir) -> bool:
    """Whether any step ran (a checkpoint or a metrics row): a launch that stopped before training (bad data, an
    interrupted Ray start) left no weights its config could be confused with."""
    return find_latest(run.path) is not None or bool(run.read_metrics())


def refuse_changed_config(run: RunDir, config_dict: dict) -> None:
    """Running a recipe onto an existing run continues it only when the config is the run's own: weights
    trained at one learning rate must never be recorded under another."""
    changes = diff(run.read_config(), config_dict, ignore=LAUNCH_KEYS)
    if changes:
        shown = shown_path(run.path)
        raise GymvError(f"{shown} holds a run with another config: {describe(changes)}", where=str(shown / "config.yaml"),
                        fix=f"continue it as recorded: gymv train --resume {shown} (overrides after it are recorded "
                            f"in config_changes.jsonl), or start a new run: add name=<new-name>")


def shown_path(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


# ------------------------------------------------------------------------------------------ workers


def worker_spec(cfg: RecipeBase, model_path: str, *, kl_reference: bool = False,
                logprob_temperature: float | None = None) -> WorkerSpec:
    """The workers' spec: the recipe's sections as they are, with this run's facts (resolved model path,
    device, generation dtype, the schedule's length) and what the loop asks for (a KL reference; SFT's
    logprobs at temperature 1)."""
    from gymv.cluster.workers import WorkerSpec

    return WorkerSpec(
        model_path=model_path, env=cfg.env, model=cfg.model, generation=cfg.generation, training=cfg.training,
        refit=cfg.refit, rollout=cfg.rollout, vision=getattr(cfg, "vision", None), seed=cfg.seed,
        device="cuda" if cfg.cluster.gpus_per_node > 0 else "cpu", generation_dtype=generation_dtype(cfg, model_path),
        logprob_temperature=logprob_temperature, total_steps=cfg.optimizer_steps, kl_reference=kl_reference,
        shares_gpu=cfg.cluster.gpus_per_node > 0 and cfg.cluster.colocated)


def check_agent_driver(cfg: RecipeBase) -> None:
    """`rollout.driver: nemo_gym_agents` runs one generation worker (the agents call one model server)."""
    if cfg.rollout.driver != "nemo_gym_agents":
        return
    if cfg.cluster.generation_workers_per_gpu != 1 or (cfg.cluster.generation_gpus or 0) > 1:
        raise GymvError("rollout.driver nemo_gym_agents runs one generation worker (the agents call one model "
                        "server)", where="cluster.generation_workers_per_gpu", fix="set it to 1")


def sampling_params(cfg: RecipeBase, *, greedy: bool = False) -> SamplingParams:
    g = cfg.generation
    return SamplingParams(temperature=0.0 if greedy else g.temperature, top_p=1.0 if greedy else g.top_p,
                          max_new_tokens=g.max_new_tokens, stop_strings=tuple(g.stop_strings))


def step_seed(seed: int, step: int, kind: str = "train") -> int:
    """The sampling seed of one step: a pure function of (run seed, step, kind), so a resumed run samples
    exactly what the uninterrupted one would have."""
    digest = hashlib.blake2b(f"gymv:{seed}:{kind}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def record_placement(ctx: RunContext, cluster) -> None:
    """Print where every worker landed (and the refit transport) and write it to placement.json."""
    record = placement_record(ctx.checked, ROSTER, getattr(cluster, "transport", None) if cluster.generators else None)
    for line in placement_lines(record):
        ctx.reporter.on_message(line)
    write_placement(ctx.run.path, record)
