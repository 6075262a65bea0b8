"""PNG plots of a run's metrics (matplotlib, Agg backend: no display needed).

Each plot is drawn only when at least one of its metrics was logged; per-environment breakdowns
(`train/reward_mean/<agent>`) are drawn beside the totals. A training series is drawn faint as logged and
bold smoothed (an exponential moving average, `smoothing` its weight, as TensorBoard's slider); validation
series are sparse and drawn as logged. Other runs given to compare are drawn dashed in the same plots. The step-time split stacks the phases of a step
that do not overlap (generation includes the environment's time) and shows the rest as "other".
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gymv.io import atomic_open

TIMING_PHASES = ("generation_s", "logprobs_s", "teacher_s", "samples_s", "training_s", "refit_s", "validation_s", "checkpoint_s")


@dataclass(frozen=True)
class PlotSpec:
    name: str
    title: str
    metrics: tuple[str, ...]
    ylabel: str = ""
    reference: float | None = None  # a dashed horizontal line (e.g. 1.1 for token_mult_prob_error)
    band: dict | None = None  # metric -> its std metric, drawn as a ±1 std band
    bounds: tuple[float, float] | None = None  # the range the metric can take: the band never leaves it


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward", ("train/reward_mean", "val/reward_mean"), "mean reward",
             band={"train/reward_mean": "train/reward_std"}, bounds=(0.0, 1.0)),
    PlotSpec("accuracy", "Accuracy (share of rollouts with reward ≥ 1)", ("train/accuracy", "val/accuracy"), "accuracy"),
    PlotSpec("loss", "Loss", ("train/loss", "train/pg_loss", "train/nll"), "loss"),
    PlotSpec("kl", "KL divergence", ("train/kl_ref", "train/kl_teacher"), "KL"),
    PlotSpec("entropy", "Entropy of the sampling distribution", ("train/entropy",), "nats / token"),
    PlotSpec("token_mult_prob_error", "token_mult_prob_error (generation vs training logprobs)",
             ("train/token_mult_prob_error",), "mean exp(|Δlogp|)", reference=1.1),
    PlotSpec("seq_mult_prob_error", "Sequence-level logprob error (max, mean, min over sequences)",
             ("train/max_seq_mult_prob_error", "train/mean_seq_mult_prob_error", "train/min_seq_mult_prob_error",
              "train/max_seq_mult_prob_error_after_mask"), "mean exp(|Δlogp|) per sequence"),
    PlotSpec("masked_seqs", "Sequences masked for logprob error", ("train/num_masked_seqs_by_logprob_error",),
             "sequences"),
    PlotSpec("teacher_advantage", "MOPD teacher advantage (log π_teacher − log π_student per token)",
             ("train/teacher_advantage", "train/teacher_advantage_min", "train/teacher_advantage_max"), "nats"),
    PlotSpec("teacher_batches", "MOPD teacher logprob batches per step", ("train/num_teacher_batches",), "batches"),
    PlotSpec("grad_norm", "Gradient norm", ("train/grad_norm",), "L2 norm"),
    PlotSpec("response_length", "Response length (generated tokens per rollout)",
             ("train/gen_length_mean", "train/gen_length_max", "val/gen_length_mean"), "tokens"),
    PlotSpec("zero_std_groups", "Groups whose rewards are all equal (no learning signal)",
             ("train/zero_std_group_fraction",), "share of groups"),
    PlotSpec("lr", "Learning rate", ("train/lr",), "learning rate"),
)
DEFAULT_SMOOTHING = 0.6


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    file: str  # relative to the report folder
    metrics: tuple[str, ...]  # those actually drawn


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _broken(v: object) -> bool:
    """A value logged where a number belongs that is not one: null (gymv's logger writes NaN and infinities
    so, strict JSON having neither), NaN or an infinity written by another tool, a string."""
    return v is None or isinstance(v, str) or (isinstance(v, float) and not math.isfinite(v))


def _series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v, s = r.get(key), r.get("step")
        if isinstance(s, int) and _finite(v):
            xs.append(s)
            ys.append(float(v))
    return xs, ys


def _gaps(rows: Sequence[dict], key: str) -> list[int]:
    """Steps whose value of `key` is not a finite number: drawn as breaks in the line, with a marker."""
    return [r["step"] for r in rows if isinstance(r.get("step"), int) and _broken(r.get(key))]


def non_finite_values(rows: Sequence[dict]) -> list[tuple[int, str]]:
    """(step, metric) of every value that is not a finite number (the report counts them in its header)."""
    return [(r.get("step"), k) for r in rows for k, v in r.items() if _broken(v)]


def _with_gaps(xs: list[int], ys: list[float], gaps: list[int]) -> tuple[list[int], list[float]]:
    """The series with NaN at each gap step, so that the line breaks there instead of bridging it."""
    points = sorted([*zip(xs, ys), *((g, math.nan) for g in gaps)], key=lambda p: p[0])
    return [p[0] for p in points], [p[1] for p in points]


def smooth(ys: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average, debiased at the start (the first point is not pulled toward zero)."""
    out, last, norm = [], 0.0, 0.0
    for y in ys:
        last = weight * last + (1 - weight) * y
        norm = weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def _qualified(rows: Sequence[dict], base: str) -> list[str]:
    keys = sorted({k for r in rows for k in r if k.startswith(base + "/")})
    return keys[:8]  # enough to read; more lines would be noise


def _figure(title: str, ylabel: str):
    from matplotlib.figure import Figure  # the object API renders with Agg; pyplot (and a display) never loads

    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.ticklabel_format(axis="y", useOffset=False)  # 6.9051, not "+6.905" and 0.0005
    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> None:
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")


def _band(ax, rows: Sequence[dict], spec: PlotSpec, key: str, xs: list[int], ys: list[float], color) -> None:
    std_key = (spec.band or {}).get(key)
    if not std_key:
        return
    sx, sy = _series(rows, std_key)
    std = dict(zip(sx, sy))
    pts = [(x, y, std[x]) for x, y in zip(xs, ys) if x in std]
    if not pts:
        return
    lows, highs = band_edges([p[1] for p in pts], [p[2] for p in pts], spec.bounds)
    ax.fill_between([p[0] for p in pts], lows, highs, color=color, alpha=0.15, linewidth=0)


def band_edges(means: Sequence[float], stds: Sequence[float],
               bounds: tuple[float, float] | None) -> tuple[list[float], list[float]]:
    """mean ± std, kept inside `bounds` (widened to the means themselves should a mean leave them): a reward
    in [0, 1] has no mass outside it, whatever mean ± std says."""
    lo, hi = -math.inf, math.inf
    if bounds is not None and means:
        lo, hi = min(bounds[0], min(means)), max(bounds[1], max(means))
    return [max(lo, m - s) for m, s in zip(means, stds)], [min(hi, m + s) for m, s in zip(means, stds)]


def _draw(ax, xs: list[int], ys: list[float], label: str, smoothing: float, *, dashed: bool = False, color=None,
          gaps: Sequence[int] = ()):
    """The series as logged (faint, when smoothed) and smoothed (bold), broken at `gaps` (steps whose value is
    not a finite number) with an x on the axis there; returns the bold line."""
    style = "--" if dashed else "-"
    if smoothing > 0 and len(xs) > 2 and not label.startswith("val/"):
        (raw,) = ax.plot(*_with_gaps(xs, ys, list(gaps)), linestyle=style, linewidth=1, alpha=0.3, color=color)
        (line,) = ax.plot(*_with_gaps(xs, smooth(ys, smoothing), list(gaps)), linestyle=style, linewidth=1.8,
                          label=label, color=raw.get_color())
    else:
        marker = "o" if len(xs) < 30 or label.startswith("val/") else None
        (line,) = ax.plot(*_with_gaps(xs, ys, list(gaps)), linestyle=style, marker=marker, markersize=3,
                          linewidth=1.5, label=label, color=color)
    if gaps:
        ax.plot(list(gaps), [0.0] * len(gaps), linestyle="none", marker="x", markersize=7, color=line.get_color(),
                transform=ax.get_xaxis_transform(), clip_on=False)
    return line


def line_plot(rows: Sequence[dict], spec: PlotSpec, out: Path, *, smoothing: float = DEFAULT_SMOOTHING,
              compare: Sequence[tuple[str, Sequence[dict]]] = (), name: str | None = None) -> Plot | None:
    drawn: list[str] = []
    fig, ax = _figure(spec.title, spec.ylabel)
    suffix = f" ({name})" if compare and name else ""
    colors: dict[str, object] = {}
    for key in spec.metrics:
        xs, ys = _series(rows, key)
        if not xs:
            continue
        line = _draw(ax, xs, ys, key + suffix, smoothing, gaps=_gaps(rows, key))
        colors[key] = line.get_color()
        drawn.append(key)
        _band(ax, rows, spec, key, xs, ys, line.get_color())
        for q in ([] if compare else _qualified(rows, key)):
            qx, qy = _series(rows, q)
            if qx:
                ax.plot(qx, qy, linestyle="--", linewidth=1, label=q)
                drawn.append(q)
    for other_name, other_rows in compare:  # the same metrics of each other run, dashed, in the same colors
        for key in spec.metrics:
            xs, ys = _series(other_rows, key)
            if xs:
                _draw(ax, xs, ys, f"{key} ({other_name})", smoothing, dashed=True, color=colors.get(key),
                      gaps=_gaps(other_rows, key))
                if key not in drawn:
                    drawn.append(key)
    if not drawn:
        return None
    if spec.reference is not None:
        ax.axhline(spec.reference, color="crimson", linestyle=":", linewidth=1, label=f"{spec.reference:g}")
    ax.legend(fontsize=8, loc="best")
    file = f"plots/{spec.name}.png"
    _save(fig, out / file)
    return Plot(spec.name, spec.title, file, tuple(drawn))


def timing_plot(rows: Sequence[dict], out: Path) -> Plot | None:
    """Seconds per step, stacked by phase; `other` is what step_s has beyond the phases."""
    steps = sorted({r["step"] for r in rows if isinstance(r.get("step"), int) and
                    any(isinstance(r.get(f"timing/{p}"), (int, float)) for p in (*TIMING_PHASES, "step_s"))})
    if not steps:
        return None
    by_step: dict[int, dict] = {}
    for r in rows:
        if isinstance(r.get("step"), int):
            by_step.setdefault(r["step"], {}).update(r)
    phases = [p for p in TIMING_PHASES if any(isinstance(by_step[s].get(f"timing/{p}"), (int, float)) for s in steps)]
    values = {p: [float(by_step[s].get(f"timing/{p}") or 0.0) for s in steps] for p in phases}
    totals = [by_step[s].get("timing/step_s") for s in steps]
    if any(isinstance(t, (int, float)) for t in totals):
        values["other"] = [max(0.0, float(t) - sum(values[p][i] for p in phases)) if isinstance(t, (int, float)) else 0.0
                           for i, t in enumerate(totals)]
    fig, ax = _figure("Step time split", "seconds")
    bottom = [0.0] * len(steps)
    width = 0.8 if len(steps) < 2 else 0.8 * min(b - a for a, b in zip(steps, steps[1:]))
    for label, vals in values.items():
        if not any(vals):
            continue
        ax.bar(steps, vals, width=width, bottom=bottom, label=label.removesuffix("_s"),
               color="lightgray" if label == "other" else None)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylim(0, max(bottom) * 1.3 if max(bottom) > 0 else 1)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper left", ncols=4)
    file = "plots/timing.png"
    _save(fig, out / file)
    return Plot("timing", "Step time split", file, tuple(f"timing/{p}" for p in values if p != "other"))


def write_plots(rows: Sequence[dict], out_dir: str | os.PathLike, *, smoothing: float = DEFAULT_SMOOTHING,
                compare: Sequence[tuple[str, Sequence[dict]]] = (), name: str | None = None) -> list[Plot]:
    """Draw every plot that has data into out_dir/plots/; returns those drawn, in PLOTS order, timing last.

    `compare` holds (name, metric rows) of other runs to draw beside this one (`name`)."""
    out = Path(out_dir)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    drawn = [p for p in (line_plot(rows, spec, out, smoothing=smoothing, compare=compare, name=name) for spec in PLOTS)
             if p is not None]
    t = timing_plot(rows, out)
    if t is not None:
        drawn.append(t)
    wanted = {f"{p.name}.png" for p in drawn}
    for stale in (out / "plots").glob("*.png"):  # a plot whose data is gone (a resumed run rewound) goes too
        if stale.name not in wanted:
            stale.unlink(missing_ok=True)
    return drawn
