"""`gymv train`: load a recipe, open the run directory, prepare data, start Ray, run the algorithm's loop.

    from gymv.train import train
    summary = train("recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", ["grpo.max_steps=3"])

Every algorithm runs one loop (loop.py: restore, steps, validation, checkpoints, the step's timer); an
algorithm's own step is its file, read top to bottom: sft.py, grpo.py, mopd.py, and grpo_async.py with
generation running ahead in pipeline.py and replay.py. The math they call is gymv.algorithms. The builders
they share live here too (data, setup, stats, validation), with the guards that stop a bad run (failures,
logprob_guard) and what surrounds a launch (launch: pre-flight, placement, restarts).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gymv.backends.registry import GENERATION_BACKENDS, TEACHER_BACKENDS
from gymv.capabilities import family_gaps, gaps, missing_packages
from gymv.cluster.ray_cluster import start_ray, stop_ray
from gymv.cluster.teachers import teacher_specs
from gymv.config import load_recipe
from gymv.envs.routing import EnvRouter
from gymv.errors import GymvError
from gymv.loggers import build_loggers, logger_classes
from gymv.models.config_check import check_checkpoint
from gymv.registry import import_object
from gymv.runs.config_history import change_overrides, describe, read_changes
from gymv.train.data import training_rows
from gymv.train.launch import check_joined, check_machine, ray_running, wait_for_nodes, with_restarts
from gymv.train.row_checks import check_training_rows
from gymv.train.setup import (
    Reporter,
    RunContext,
    check_agent_driver,
    generation_dtype,
    open_run,
    resolve_init_path,
    shown_path,
)
# the loops (torch, the workers) load once the run starts: a bad recipe is refused without them

__all__ = ["Reporter", "load_training_recipe", "train"]

SUPPORTED = ("sft", "vlm_sft", "grpo", "vlm_grpo", "mopd", "vlm_mopd")


def load_training_recipe(recipe: str | os.PathLike | None, overrides: Sequence[str] = (), *, resume_dir: str | None = None,
                         smoke: bool = False, async_grpo: bool = False):
    """The recipe to run: RECIPE with overrides, or (with only --resume) the run's own config.yaml.

    `async_grpo` (`gymv train --async`) sets grpo.async.enabled (mopd.async.enabled), after checking that the
    recipe is GRPO or MOPD."""
    if async_grpo:
        base = load_training_recipe(recipe, overrides, resume_dir=resume_dir, smoke=smoke)
        family = base.validated.base_algorithm
        if family not in ("grpo", "mopd"):
            raise GymvError(f"--async runs GRPO or MOPD asynchronously, but this recipe's algorithm is "
                            f"{base.validated.algorithm!r}", where=_where(base, "algorithm"),
                            fix="drop --async, or pass a (vlm_)grpo or (vlm_)mopd recipe")
        overrides = [*overrides, f"{family}.async.enabled=true"]

    if recipe is None:
        if resume_dir is None:
            raise GymvError("no recipe given", fix="gymv train RECIPE, or gymv train --resume RUN_DIR")
        recipe = Path(resume_dir) / "config.yaml"
        if not recipe.exists():
            raise GymvError("not a gymv run directory (no config.yaml)", where=str(resume_dir),
                            fix="pass the runs/<name> folder of an earlier `gymv train`")

        overrides = [*change_overrides(read_changes(resume_dir)), *overrides]  # the run's current config
    if resume_dir is not None:
        _refuse_algorithm_change(resume_dir, overrides)
    rec = load_recipe(recipe, list(overrides), smoke=smoke)
    if resume_dir is not None:
        _refuse_algorithm_change(resume_dir, [], rec.validated.algorithm, _where(rec, "algorithm"))
    return rec


def _refuse_algorithm_change(resume_dir, overrides: Sequence[str], algorithm: str | None = None,
                             where: str | None = None) -> None:
    """`--resume` continues a run as recorded: an override (or a recipe) of another algorithm would train
    something else on its checkpoints, and its sections would not even fit the run's config."""
    from gymv.config.overrides import looks_like_override, parse_override
    from gymv.runs.run_dir import RunDir

    try:
        recorded = RunDir(resume_dir).read_config().get("algorithm")
    except GymvError:
        return  # no readable config.yaml: open_run says so
    for text in overrides:
        if isinstance(text, str) and looks_like_override(text):
            o = parse_override(text)
            if o.key == "algorithm":
                algorithm, where = (None if o.op == "delete" else o.value), f"<command line: {text}>"
    if algorithm == recorded or where is None:
        return
    shown = shown_path(Path(resume_dir).absolute())
    raise GymvError(f"{shown} holds a {recorded} run: --resume continues it as recorded, and algorithm {algorithm} "
                    "would train something else on its checkpoints", where=where,
                    fix=f"drop the algorithm change to resume it, or start a new {algorithm} run from its weights: "
                        f"gymv train <a {algorithm} recipe> model.path={shown}")


def _where(rec, key: str) -> str:
    origin = rec.origin(key)
    return str(origin) if origin is not None else key


def _check_supported(rec, cfg) -> None:
    if cfg.algorithm not in SUPPORTED:
        raise GymvError(f"gymv train does not run {cfg.algorithm!r} yet", where=_where(rec, "algorithm"),
                        fix=f"use one of: {', '.join(SUPPORTED)}")
    if cfg.refit.transport == "nccl" and cfg.cluster.colocated:
        raise GymvError("refit transport nccl cannot broadcast between a trainer and a generator on the same GPU",
                        where=_where(rec, "refit.transport"),
                        fix="use cuda_ipc when colocated, or set cluster.colocated: false for nccl")
    for gap in gaps(cfg):
        raise GymvError(gap.message, where=_where(rec, gap.key), fix=gap.fix)
    check_agent_driver(cfg)
    try:
        logger_classes(cfg)  # a missing TensorBoard/W&B library fails here, before the run directory is written
    except GymvError as e:
        raise GymvError(e.message, where=_where(rec, e.where or "logger"), fix=e.fix) from None
    for gap in missing_packages(cfg):  # the package a backend's registry entry declares it needs
        raise GymvError(gap.message, where=_where(rec, gap.key), fix=gap.fix)


@dataclass(frozen=True)
class _ModelCheck:
    """One backend's `model_check` (an import path) for one checkpoint, as the recipe would run it."""
    check: str
    key: str  # the recipe key that chose the backend
    backend: str
    path: str
    device: str
    dtype: str
    text_only: bool = False

    def refusal(self) -> tuple[str, str] | None:
        """(why, fix) when the backend cannot run the checkpoint there, else None."""
        return import_object(self.check)(self.path, self.device, self.dtype, text_only=self.text_only)


def _check_models(rec, cfg, model_path: str) -> None:
    """A checkpoint that a backend's registry entry declares it cannot run where the recipe puts it (its
    `model_check`; vLLM's words gymv.capabilities.VLLM_FAMILY_LIMITS) is refused here, from the checkpoints'
    configs, before the run directory is written and Ray starts."""
    check_checkpoint(model_path)  # its config.json against its weights and its family (gymv.models.config_check)
    checks: list[_ModelCheck] = []
    g = cfg.generation
    check = GENERATION_BACKENDS.capabilities(g.backend).model_check
    if check:
        device = "cuda" if cfg.cluster.gpus_per_node > 0 else "cpu"
        checks.append(_ModelCheck(check, "generation.backend", g.backend, model_path, device,
                                  generation_dtype(cfg, model_path)))
    mopd = getattr(cfg, "mopd", None)
    teachers = {alias: TEACHER_BACKENDS.capabilities(t.backend).model_check
                for alias, t in (mopd.teachers.items() if mopd is not None else ())}
    for alias, spec in (teacher_specs(cfg, model_path).items() if teachers else ()):
        check_checkpoint(spec.path)
        if teachers[alias]:
            checks.append(_ModelCheck(teachers[alias], f"mopd.teachers.{alias}.backend",
                                      mopd.teachers[alias].backend, spec.path, spec.device, spec.dtype,
                                      spec.text_of))
    for c in checks:
        refused = c.refusal()
        if refused:
            raise GymvError(f"{c.key} {c.backend} cannot run {c.path}: {refused[0]}", where=_where(rec, c.key),
                            fix=refused[1])


def train(recipe: str | os.PathLike | None, overrides: Sequence[str] = (), *, resume_dir: str | None = None,
          ray_address: str | None = None, reporter: Reporter | None = None, smoke: bool = False,
          async_grpo: bool = False, max_restarts: int | None = None) -> dict:
    """Run one recipe to `max_steps` (or `checkpoint.steps_per_run` steps); returns a summary.

    `smoke` applies the recipe's `smoke:` overrides first (what `gymv smoke` runs); `async_grpo` is
    `gymv train --async` (grpo.async.enabled or mopd.async.enabled). After a lost node or worker the run
    resumes from its newest complete checkpoint, at most `max_restarts` times (None: `cluster.max_restarts`).
    Metrics are in `<summary["run_dir"]>/metrics.jsonl`.
    """
    reporter = reporter or Reporter()
    overrides = list(overrides)
    if max_restarts is not None:
        overrides.append(f"cluster.max_restarts={max_restarts}")
    first = load_training_recipe(recipe, overrides, resume_dir=resume_dir, smoke=smoke, async_grpo=async_grpo)
    c = first.validated.cluster

    def run_once(restart_dir: str | None, after: GymvError | None) -> dict:
        if restart_dir is None:
            return _train_once(first, resume_dir, ray_address, reporter)
        if ray_running():  # a joined cluster: its scheduler may be bringing a replacement node
            wait_for_nodes(c.num_nodes, c.placement_timeout_s, reporter.on_message, getattr(after, "lost_node", None))
        return _train_once(load_training_recipe(None, resume_dir=restart_dir), restart_dir, ray_address, reporter)

    return with_restarts(run_once, max_restarts=c.max_restarts, say=reporter.on_message)


def _train_once(rec, resume_dir: str | None, ray_address: str | None, reporter: Reporter) -> dict:
    """One launch of the loaded recipe `rec`: checks, run directory, data, Ray, the loop."""
    t0 = time.time()
    cfg = rec.validated
    _check_supported(rec, cfg)
    address = ray_address or cfg.cluster.ray_address
    where = lambda key: _where(rec, key)  # noqa: E731
    local = not address and not ray_running()
    if local:
        checked, gpus = check_machine(cfg, where, str(shown_path(rec.path)))
    else:  # join first: the cluster is checked before anything is written
        if not ray_running():
            reporter.on_message(f"joining Ray at {address}")
        info = start_ray(address, connect_timeout_s=cfg.cluster.connect_timeout_s,
                         timeout_key="cluster.connect_timeout_s",
                         where="--ray-address" if ray_address else "cluster.ray_address")
        checked = check_joined(cfg, info.address, where, str(shown_path(rec.path)))
    model_path = resolve_init_path(cfg.model.path, where=_where(rec, "model.path"))
    for gap in family_gaps(cfg, model_path):  # what the model's family cannot run, before Ray starts
        raise GymvError(gap.message, where=_where(rec, gap.key), fix=gap.fix)
    _check_models(rec, cfg, model_path)
    router = EnvRouter(cfg.env)  # an unknown env.name fails before anything is written

    run, resume = open_run(cfg, cfg.to_dict(), resume_dir)
    reporter.on_run(run.path)
    reporter.on_message(f"run directory {run.path}")
    if run.changes:
        reporter.on_message(f"config changed for this launch: {describe(run.changes, limit=6)} "
                            "(recorded in config_changes.jsonl; config.yaml keeps the original)")
    train_rows, eval_rows = training_rows(cfg, run.path)
    router.check(train_rows)
    router.check(eval_rows)
    vision = getattr(cfg, "vision", None)
    check_training_rows([*train_rows, *eval_rows], model_path=model_path, max_seq_len=cfg.model.max_seq_len,
                        max_pixels=vision.max_image_pixels if vision is not None else None,
                        max_images=vision.max_images_per_sample if vision is not None else None)

    run.loggers = build_loggers(cfg, cfg.to_dict(), run.path)
    if local:
        try:
            reporter.on_message("starting a local Ray cluster")
            info = start_ray(num_gpus=gpus)
        except BaseException:
            _close_loggers(run)
            raise
    ctx = RunContext(cfg=cfg, run=run, model_path=model_path, train_rows=train_rows, eval_rows=eval_rows,
                     ray_address=info.address, reporter=reporter, train_source=_source(train_rows),
                     eval_source=_source(eval_rows), checked=checked)
    try:
        result = _run_loop(ctx, cfg, resume)
    except GymvError as e:
        latest = run.checkpoints().latest()
        note = f"; the run stopped, its newest complete checkpoint is {latest}" if latest else "; the run stopped before its first checkpoint"
        stopped = GymvError(e.message + note, where=e.where, fix=e.fix, exit_code=e.exit_code)
        stopped.run_dir = str(run.path)  # where an automatic restart resumes (gymv.train.launch)
        stopped.lost_node = getattr(e, "lost_node", None)  # which node it waits to see dropped
        raise stopped from None
    finally:
        _close_loggers(run)
        if info.started_here:
            stop_ray()
    return summarize(cfg, run, result, time.time() - t0)


def _run_loop(ctx: RunContext, cfg, resume: bool) -> dict:
    if cfg.base_algorithm == "sft":
        from gymv.train.sft import train_sft

        return train_sft(ctx, resume=resume)
    if cfg.base_algorithm == "mopd":
        from gymv.train.mopd import train_mopd

        return train_mopd(ctx, resume=resume)
    if cfg.grpo.async_.enabled:
        from gymv.train.grpo_async import train_grpo_async

        return train_grpo_async(ctx, resume=resume)
    from gymv.train.grpo import train_grpo

    return train_grpo(ctx, resume=resume)


def _close_loggers(run) -> None:
    for logger in run.loggers:
        logger.close()


def _source(rows) -> str | None:
    """The file all rows came from (for "FILE line N" in rollout errors), else None."""
    files = {r.where.rsplit(" line ", 1)[0] for r in rows}
    return files.pop() if len(files) == 1 else None


def summarize(cfg, run, result: dict, wall_s: float) -> dict:
    """The end-of-run summary: where things are, how far it got, first/last rewards and accuracies, timings."""
    rows = [r for r in run.read_metrics()]
    train_rows = [r for r in rows if r.get("step", 0) > 0]

    def series(key: str) -> list[float]:
        return [r[key] for r in rows if r.get(key) is not None]

    def mean_of(key: str) -> float | None:
        vals = [r[key] for r in train_rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    summary = {
        "run_dir": str(run.path), "algorithm": cfg.algorithm, "step": result["step"], "max_steps": result["max_steps"],
        "steps_run": result["steps_run"], "complete": result["step"] >= result["max_steps"],
        "final_dir": result.get("final_dir"), "latest_checkpoint": str(run.checkpoints().latest() or "") or None,
        "wall_s": wall_s,
    }
    for key in ("train/reward_mean", "train/accuracy", "train/loss", "val/accuracy", "val/reward_mean"):
        s = series(key)
        if s:
            summary[f"first {key}"] = s[0]
            summary[f"last {key}"] = s[-1]
    for key in ("timing/step_s", "timing/generation_s", "timing/logprobs_s", "timing/training_s", "timing/refit_s",
                "train/token_mult_prob_error"):
        m = mean_of(key)
        if m is not None:
            summary[f"mean {key}"] = m
    return summary
