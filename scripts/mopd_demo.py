"""MOPD with images on a CPU, end to end with `gymv train`: two teachers, one student, one mixed dataset.

    .venv/bin/python scripts/mopd_demo.py --out /tmp/mopd-demo --plot docs/mopd-demo.png --json docs/mopd-demo.json

1. Data: circle-count `tiny` with radius 9 (the quickstart's image task: 1-3 circles of one color in a 56 px
   image) and arithmetic `tiny` (one-digit sums, text only); train rows and held-out eval rows come from
   disjoint seed ranges, and the mixed files interleave the two tasks evenly (as `gymv prepare mix` does).
2. Teachers: the counting teacher is a tiny LLaVA larger than the student (hidden 192, 2 text layers:
   1.15 M parameters) trained on circle-count alone (SFT on gold answers, then GRPO on the reward); the
   arithmetic teacher is the same architecture trained by SFT on arithmetic alone, used as `text:` (its
   language model, which never sees an image argument).
3. Student: the quickstart's tiny LLaVA (hidden 128, 1 text layer: 0.53 M parameters) with the same
   tokenizer, warm-started by SFT on the mixed rows (200 steps at lr 5e-4 after a 20-step warm-up), then
   distilled with MOPD on the mixed rows: each episode goes to the teacher of its agent (circle-count
   episodes to the counting teacher with their images, arithmetic episodes to the text teacher), which
   hands back its 16 likeliest tokens at every position of the episode (`mopd.top_k`).
4. Control: the same warm start trained by GRPO on the environment reward, same rows, samples and steps.

Every stage is an ordinary recipe (written into OUT/recipes/, inheriting the repo's CPU recipes; every
setting that matters is pinned here, so tuning the quickstart recipes changes nothing) run by
`gymv.train.train`; a stage whose run already finished is reused, so the script can be re-run after an
interruption. Accuracy is greedy, on the held-out rows, per task.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SFT_RECIPE = REPO / "recipes/vlm/vlm_sft-tinyllava-1n0g-torch.yaml"
GRPO_RECIPE = REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"
MOPD_RECIPE = REPO / "recipes/vlm/vlm_mopd-tinyllava-1n0g-torch.yaml"

# tiny LLaVA sizes (seed 0: one tokenizer for all): both teachers are wider and deeper (1.15 M parameters)
# than the student, which is the quickstart model (0.53 M)
COUNT_TEACHER = {"hidden": 192, "layers": 2, "vision_layers": 1}
ARITH_TEACHER = {"hidden": 192, "layers": 2, "vision_layers": 1}
STUDENT = {"hidden": 128, "layers": 1, "vision_layers": 1}
TEACHER_SFT_LR, TEACHER_GRPO_LR = 5.0e-4, 5.0e-5  # the student's: 1e-3 (SFT), 3e-4 (MOPD, GRPO)
TRAIN_ROWS = 2048  # per task
EVAL_ROWS = 200    # per task
CC_KNOBS = ["radius=9"]
AGENTS = {"circle_count_simple_agent": "circle-count", "arithmetic_simple_agent": "arithmetic"}


def _nested(settings: dict) -> dict:
    out: dict = {}
    for key, value in settings.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _run(out: Path, name: str, parent: Path, settings: dict) -> dict:
    """Train one stage to completion (resuming after an interruption); returns its summary."""
    from gymv.errors import GymvError
    from gymv.train import Reporter, train

    run_dir = out / "runs" / name
    recipe = out / "recipes" / f"{name}.yaml"
    data = {"defaults": str(parent), **_nested({"name": name, "checkpoint.dir": str(out / "runs"), **settings})}
    text = yaml.safe_dump(data, sort_keys=False)
    if run_dir.exists() and (not recipe.exists() or recipe.read_text() != text):
        raise SystemExit(f"{run_dir} was made with other settings than this script's {name!r} stage; "
                         f"use another --out or remove that run")
    if (run_dir / "final" / "config.json").exists() and (run_dir / "summary.json").exists():
        print(f"[{name}] done before, reused", flush=True)
        return json.loads((run_dir / "summary.json").read_text())
    recipe.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(text)

    class Say(Reporter):
        def on_step(self, step, m):
            if "val/accuracy" in m:
                per = "  ".join(f"{AGENTS.get(k.rsplit('/', 1)[1], k)} {v:.3f}" for k, v in sorted(m.items())
                                if k.startswith("val/accuracy/"))
                print(f"[{name}] step {step}: val accuracy {m['val/accuracy']:.3f}  {per}", flush=True)

    t0, load0 = time.time(), os.getloadavg()
    for attempt in range(4):
        try:
            summary = train(recipe, reporter=Say())
            break
        except GymvError as e:  # a worker killed from outside (shared machine): resume from the checkpoint
            if attempt == 3 or "died" not in e.message:
                raise
            print(f"[{name}] {e.message}; resuming", flush=True)
    summary["stage_wall_s"] = time.time() - t0
    summary["load_average_start_end"] = [round(x, 2) for x in (*load0, *os.getloadavg())]  # 1, 5, 15 min, twice
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _data(out: Path) -> dict[str, Path]:
    """Per-task train/eval files and their even interleave (what `gymv prepare mix` writes, with radius 9)."""
    from gymv.data.generate import write_dataset
    from gymv.data.mix import interleave_order
    from gymv.envs import get_env
    from gymv.envs.knobs import resolve_knobs
    from gymv.io import atomic_open

    d = out / "data"
    d.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for split, n in (("train", TRAIN_ROWS), ("eval", EVAL_ROWS)):
        parts = []
        for env_name, tag, knobs in (("circle-count", "cc", CC_KNOBS), ("arithmetic", "ar", [])):
            path = files[f"{tag}-{split}"] = d / f"{tag}-{split}.jsonl"
            if not path.exists():
                env = get_env(env_name)
                write_dataset(path, env, resolve_knobs(env, "tiny", knobs), n=n, split=split)
            parts.append(path.read_text().splitlines())
        mixed = files[f"mix-{split}"] = d / f"mix-{split}.jsonl"
        if not mixed.exists():
            cursor = [0] * len(parts)
            with atomic_open(mixed, "w", encoding="utf-8") as f:
                for i in interleave_order([len(p) for p in parts]):
                    f.write(parts[i][cursor[i]] + "\n")
                    cursor[i] += 1
    return files


def _metrics(out: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _val(rows: list[dict], key: str = "val/accuracy") -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if key in r]


def _per_task(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    return {task: _val(rows, f"val/accuracy/{agent}") for agent, task in AGENTS.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mopd-demo"))
    ap.add_argument("--plot", type=Path, default=REPO / "docs/mopd-demo.png")
    ap.add_argument("--json", type=Path, default=REPO / "docs/mopd-demo.json")
    ap.add_argument("--mopd-steps", type=int, default=800)
    ap.add_argument("--top-k", type=int, default=16,
                    help="distil each teacher's k likeliest tokens per position (0: the sampled-token advantage)")
    ap.add_argument("--no-control", action="store_true", help="skip the GRPO control run of the student")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = args.out.absolute()
    t_start = time.time()

    from gymv.models.tiny import count_parameters, init_tiny

    files = _data(out)
    models = out / "models"
    sizes = {"count-teacher-init": COUNT_TEACHER, "arith-teacher-init": ARITH_TEACHER, "student-init": STUDENT}
    for name, knobs in sizes.items():
        marker = models / name / "gymv_model.json"
        if marker.exists() and any(json.loads(marker.read_text())["knobs"][k] != v for k, v in knobs.items()):
            raise SystemExit(f"{models / name} has other sizes than {knobs}; use another --out or remove it")
        if not marker.exists():
            init_tiny("tiny-llava", models / name, force=True, **knobs)  # seed 0: one tokenizer for all

    def on(task: str) -> dict:
        return {"data.train": str(files[f"{task}-train"]), "data.eval": str(files[f"{task}-eval"]), "data.prepare": None}

    common = {"generation.max_new_tokens": 8, "generation.temperature": 1.0, "model.max_seq_len": 512,
              "env.name": "circle-count", "env.preset": "tiny", "env.max_turns": 1,
              "training.warmup_steps": 10, "checkpoint.period": 1000}
    sft = {**common, "training.lr": 1.0e-3, "sft.batch_size": 32, "sft.val_prompts": 2 * EVAL_ROWS}
    grpo = {**common, "training.lr": 3.0e-4, "grpo.loss.kl_coef": 0.0, "grpo.val_at_start": True,
            "grpo.val_prompts": 2 * EVAL_ROWS}

    # 1. teachers: counting (images) and arithmetic (text), each trained on its own task only
    # the larger teachers need lower learning rates than the student: at lr 1e-3 the counting teacher's SFT
    # stalled at 0.705 held-out (60 GRPO steps at 3e-4 then took it to 0.54); at 5e-4 it reaches 1.00. GRPO on
    # that near-perfect teacher is unstable (a group with one wrong sample gives it a large negative advantage;
    # grad norm spikes to 5-13): 40 steps at 1.5e-4 ended at 0.905, 30 at 5e-5 at 0.97 (1.00 at steps 10, 20)
    _run(out, "count-teacher-sft", SFT_RECIPE, {
        **sft, **on("cc"), "model.path": str(models / "count-teacher-init"), "training.lr": TEACHER_SFT_LR,
        "sft.max_steps": 200, "sft.val_period": 100})
    _run(out, "count-teacher-grpo", GRPO_RECIPE, {
        **grpo, **on("cc"), "model.path": str(out / "runs/count-teacher-sft"), "training.lr": TEACHER_GRPO_LR,
        "grpo.prompts_per_step": 8, "grpo.generations_per_prompt": 8, "grpo.max_steps": 20, "grpo.val_period": 10})
    _run(out, "arith-teacher-sft", SFT_RECIPE, {
        **sft, **on("ar"), "env.name": "arithmetic", "model.path": str(models / "arith-teacher-init"),
        "training.lr": TEACHER_SFT_LR, "sft.max_steps": 240, "sft.val_period": 80})
    # no GRPO for the arithmetic teacher: 60 steps of it (8 x 8, lr 3e-4) raised greedy accuracy 0.805 -> 0.835
    # while the teacher stopped ending its answers ("\boxed{11}}}}" until max_new_tokens; the verifier reads
    # the first box), so it put logprob -20 on the end-of-turn token that every student answer ends with

    # 2. student: a short SFT warm start on the mixed rows, then MOPD from both teachers
    # lr 5e-4 with a 20-step warm-up leaves the student unsure where it is wrong (the quickstart's lesson):
    # after lr 1e-3 without one it was sure of wrong counts, and MOPD and GRPO alike stalled at 0.74
    _run(out, "student-warm", SFT_RECIPE, {
        **sft, **on("mix"), "model.path": str(models / "student-init"), "training.lr": 5.0e-4,
        "training.warmup_steps": 20, "sft.max_steps": 200, "sft.val_period": 200})
    teachers = {"counting": {"path": str(out / "runs/count-teacher-grpo")},
                "arith": {"path": "text:" + str(out / "runs/arith-teacher-sft"), "data_parallel_size": 1}}
    loop = {"prompts_per_step": 16, "generations_per_prompt": 4, "max_steps": args.mopd_steps,
            "val_period": 200, "val_at_start": True, "val_prompts": 2 * EVAL_ROWS}
    # sampling at temperature 1 (the student's own distribution, which reverse KL is about) and a cosine
    # decay: at a constant 3e-4 arithmetic peaked at 0.78 mid-run and drifted down to 0.63 by step 1200
    student = {"training.lr": 3.0e-4, "generation.temperature": 1.0, "training.lr_schedule": "cosine",
               "training.min_lr_ratio": 0.1}
    mopd = _run(out, "student-mopd", MOPD_RECIPE, {
        **common, **on("mix"), "algorithm": "vlm_mopd", "model.path": str(out / "runs/student-warm"),
        **student, "mopd.top_k": args.top_k, **{f"mopd.{k}": v for k, v in loop.items()},
        "mopd.teachers": {"_override_": True, **teachers},
        "mopd.agent_to_teacher": {"_override_": True, "circle_count_simple_agent": "counting",
                                  "arithmetic_simple_agent": "arith"}})

    # 3. the control: the same warm start, rows, samples and steps, trained by GRPO on the reward alone
    control = None
    if not args.no_control:
        control = _run(out, "student-grpo-control", GRPO_RECIPE, {
            **grpo, **on("mix"), "model.path": str(out / "runs/student-warm"), **student,
            **{f"grpo.{k}": v for k, v in loop.items()}})

    # 4. numbers and the plot
    rows = _metrics(out, "student-mopd")
    teacher_acc = {"circle-count": _val(_metrics(out, "count-teacher-grpo"))[-1][1],
                   "arithmetic": _val(_metrics(out, "arith-teacher-sft"))[-1][1]}
    mopd_val = _per_task(rows)

    def gap_closed(series: list[tuple[int, float]], task: str) -> float | None:
        before, after, teacher = mopd_val[task][0][1], series[-1][1], teacher_acc[task]
        return (after - before) / (teacher - before) if teacher > before else None

    kl = {k.rsplit("/", 1)[1]: [(r["step"], round(r[k], 4)) for r in rows if k in r]
          for k in sorted({k for r in rows for k in r if k.startswith("train/kl_teacher/")})}
    result = {
        "task": (f"mixed: circle-count tiny radius 9 (image) + arithmetic tiny (text), {TRAIN_ROWS} train rows and "
                 f"{EVAL_ROWS} held-out eval rows of each, greedy accuracy per task"),
        "models": {name: {"parameters": count_parameters(models / name), **knobs} for name, knobs in sizes.items()},
        "teacher_accuracy": teacher_acc,
        "teachers": {"count_sft_val": _val(_metrics(out, "count-teacher-sft")),
                     "count_grpo_val": _val(_metrics(out, "count-teacher-grpo")),
                     "arith_sft_val": _val(_metrics(out, "arith-teacher-sft"))},
        "student_accuracy_before": {t: s[0][1] for t, s in mopd_val.items()},
        "student_accuracy_after": {t: s[-1][1] for t, s in mopd_val.items()},
        "gap_closed_fraction": {t: gap_closed(s, t) for t, s in mopd_val.items()},
        "gap_closed_fraction_both_tasks": _both(mopd_val, teacher_acc),
        "mopd": {"top_k": args.top_k, "val_accuracy": mopd_val, "reverse_kl": kl, "steps": rows[-1]["step"],
                 "run_wall_s": mopd.get("wall_s"), "stage_wall_s": mopd.get("stage_wall_s")},
    }
    if control is not None:
        cval = _per_task(_metrics(out, "student-grpo-control"))
        result["grpo_control"] = {"val_accuracy": cval, "run_wall_s": control.get("wall_s"),
                                  "accuracy_after": {t: s[-1][1] for t, s in cval.items()},
                                  "gap_closed_fraction": {t: gap_closed(s, t) for t, s in cval.items()},
                                  "gap_closed_fraction_both_tasks": _both(cval, teacher_acc, mopd_val)}
    stages = ["count-teacher-sft", "count-teacher-grpo", "arith-teacher-sft", "student-warm",
              "student-mopd"] + ([] if control is None else ["student-grpo-control"])
    result["stage_wall_s"] = {n: round(json.loads((out / "runs" / n / "summary.json").read_text())["stage_wall_s"], 1)
                              for n in stages}
    result["stage_load_average_start_end"] = {
        n: json.loads((out / "runs" / n / "summary.json").read_text()).get("load_average_start_end") for n in stages}
    result["this_invocation_wall_s"] = round(time.time() - t_start, 1)  # less than the sum when stages were reused
    result["load_average"] = os.getloadavg()
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, args.plot)
    print(json.dumps({k: result[k] for k in ("teacher_accuracy", "student_accuracy_before", "student_accuracy_after",
                                             "gap_closed_fraction", "gap_closed_fraction_both_tasks", "stage_wall_s")},
                     indent=2))


def _both(series: dict, teacher: dict, start: dict | None = None) -> float:
    """The gap closed on the mean accuracy of the two tasks (each has the same number of held-out rows)."""
    start = start or series
    before = sum(start[t][0][1] for t in teacher) / len(teacher)
    after = sum(series[t][-1][1] for t in teacher) / len(teacher)
    goal = sum(teacher.values()) / len(teacher)
    return (after - before) / (goal - before)


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    for alias, series in result["mopd"]["reverse_kl"].items():
        xs, ys = [s for s, _ in series], [v for _, v in series]
        line, = a.plot(xs, ys, alpha=0.3)
        k = 15  # a trailing mean over k steps
        smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        a.plot(xs, smooth, color=line.get_color(), label=f"teacher {alias!r} ({k}-step mean)")
    a.set_xlabel("MOPD step")
    a.set_ylabel("KL(student || teacher) per token")
    a.set_title("reverse KL to each teacher (student samples)")
    a.legend()
    colors = {"circle-count": "tab:blue", "arithmetic": "tab:green"}
    for task, series in result["mopd"]["val_accuracy"].items():
        c = colors[task]
        b.plot([s for s, _ in series], [v for _, v in series], marker="o", color=c, label=f"{task}: MOPD")
        if "grpo_control" in result:
            cv = result["grpo_control"]["val_accuracy"][task]
            b.plot([s for s, _ in cv], [v for _, v in cv], marker="s", linestyle=":", color=c, alpha=0.7,
                   label=f"{task}: GRPO control")
        b.axhline(result["teacher_accuracy"][task], color=c, linestyle="--", alpha=0.6, label=f"{task}: teacher")
    b.set_ylim(0, 1.02)
    b.set_xlabel("step (64 student samples each)")
    b.set_ylabel("held-out accuracy (greedy)")
    b.set_title("student held-out accuracy per task")
    b.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
