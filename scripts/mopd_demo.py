"""MOPD on a CPU, end to end with `gymv train`: train a teacher (SFT, then GRPO), warm-start a smaller
student, distil the teacher into the student with MOPD for at most ten minutes, and report how much of the
held-out accuracy gap MOPD closed, with the reverse-KL curve per teacher.

    .venv/bin/python scripts/mopd_demo.py --out /tmp/mopd-demo --plot docs/mopd-demo.png --json docs/mopd-demo.json

Every stage is an ordinary recipe (written into OUT/recipes/, inheriting the repo's CPU recipes) run by
`gymv.train.train`; a stage whose run already finished is reused, so the script can be re-run after an
interruption. The task is `arithmetic` (`tiny` preset: one-digit sums, 100 distinct problems): the eval
split holds rows of other seeds, not problems the training split never contains.
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

TEACHER = {"hidden": 192, "layers": 4, "intermediate": 576}
STUDENT = {"hidden": 64, "layers": 2, "intermediate": 192}
EVAL_ROWS = 200


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
    if (run_dir / "final" / "config.json").exists() and (run_dir / "summary.json").exists():
        print(f"[{name}] done before, reused", flush=True)
        return json.loads((run_dir / "summary.json").read_text())
    recipe = out / "recipes" / f"{name}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    data = {"defaults": str(parent), **_nested({"name": name, "checkpoint.dir": str(out / "runs"), **settings})}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))

    class Say(Reporter):
        def on_step(self, step, m):
            if "val/accuracy" in m:
                print(f"[{name}] step {step}: val accuracy {m['val/accuracy']:.3f}", flush=True)

    t0 = time.time()
    for attempt in range(4):
        try:
            summary = train(recipe, reporter=Say())
            break
        except GymvError as e:  # a worker killed from outside (shared machine): resume from the checkpoint
            if attempt == 3 or "died" not in e.message:
                raise
            print(f"[{name}] {e.message}; resuming", flush=True)
    summary["stage_wall_s"] = time.time() - t0
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _metrics(out: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _val(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["val/accuracy"]) for r in rows if "val/accuracy" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mopd-demo"))
    ap.add_argument("--plot", type=Path, default=REPO / "docs/mopd-demo.png")
    ap.add_argument("--json", type=Path, default=REPO / "docs/mopd-demo.json")
    ap.add_argument("--mopd-steps", type=int, default=700)
    ap.add_argument("--budget-s", type=float, default=600.0, help="MOPD wall-clock budget (the claim: <= 10 minutes)")
    ap.add_argument("--no-control", action="store_true", help="skip the GRPO control run of the student")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = args.out.absolute()

    from gymv.models.tiny import count_parameters, init_tiny

    models = out / "models"
    for name, knobs in (("teacher-init", TEACHER), ("student-init", STUDENT)):
        if not (models / name / "config.json").exists():
            init_tiny("tiny-llava", models / name, force=True, **knobs)  # seed 0: one tokenizer for both

    # every setting that matters is pinned here, so later tuning of the quickstart recipes changes nothing
    common = {"env.name": "arithmetic", "env.preset": "tiny", "data.prepare.n_train": 2048,
              "data.prepare.n_eval": EVAL_ROWS, "data.prepare.knobs": {"_override_": True},
              "generation.max_new_tokens": 8, "generation.temperature": 1.0, "model.max_seq_len": 512}

    # 1. teacher: SFT on the gold answers, then GRPO on the reward
    _run(out, "teacher-sft", SFT_RECIPE, {
        **common, "model.path": str(models / "teacher-init"), "training.lr": 1.0e-3, "training.warmup_steps": 20,
        "sft.max_steps": 250, "sft.batch_size": 32, "sft.val_period": 50, "sft.val_prompts": EVAL_ROWS,
        "checkpoint.period": 50})
    _run(out, "teacher-grpo", GRPO_RECIPE, {
        **common, "model.path": str(out / "runs/teacher-sft"), "training.lr": 1.0e-4,
        "grpo.prompts_per_step": 16, "grpo.generations_per_prompt": 4, "grpo.max_steps": 60, "grpo.loss.kl_coef": 0.0,
        "grpo.val_period": 20, "grpo.val_at_start": True, "grpo.val_prompts": EVAL_ROWS, "checkpoint.period": 20})

    # 2. student: a short SFT warm start (the answer format), then MOPD from the teacher
    _run(out, "student-warm", SFT_RECIPE, {
        **common, "model.path": str(models / "student-init"), "training.lr": 2.0e-3, "training.warmup_steps": 5,
        "sft.max_steps": 100, "sft.batch_size": 32, "sft.val_period": 100, "sft.val_prompts": EVAL_ROWS,
        "checkpoint.period": 100})
    teacher_path = str(out / "runs/teacher-grpo")
    mopd = _run(out, "student-mopd", MOPD_RECIPE, {
        **common, "algorithm": "vlm_mopd", "model.path": str(out / "runs/student-warm"), "training.lr": 1.0e-4,
        "generation.temperature": 0.5,  # student and teacher both scored at 0.5: fewer junk samples, less variance
        "mopd.prompts_per_step": 16, "mopd.generations_per_prompt": 4, "mopd.max_steps": args.mopd_steps,
        "mopd.val_period": 50, "mopd.val_at_start": True, "mopd.val_prompts": EVAL_ROWS,
        "mopd.teachers": {"_override_": True, "arith": {"path": f"text:{teacher_path}"}},
        "mopd.agent_to_teacher": {"_override_": True, "arithmetic_simple_agent": "arith"},
        "checkpoint.period": 50})

    # 3. the control: the same student, samples and budget, trained by GRPO on the environment reward alone
    control = None
    if not args.no_control:
        control = _run(out, "student-grpo-control", GRPO_RECIPE, {
            **common, "model.path": str(out / "runs/student-warm"), "training.lr": 1.0e-4,
            "generation.temperature": 0.5, "grpo.loss.kl_coef": 0.0,
            "grpo.prompts_per_step": 16, "grpo.generations_per_prompt": 4, "grpo.max_steps": args.mopd_steps,
            "grpo.val_period": 50, "grpo.val_at_start": True, "grpo.val_prompts": EVAL_ROWS, "checkpoint.period": 100})

    # 4. numbers and the plot
    teacher_acc = _val(_metrics(out, "teacher-grpo"))[-1][1]
    rows = _metrics(out, "student-mopd")
    val = _val(rows)
    student_start, student_end = val[0][1], val[-1][1]
    gap = teacher_acc - student_start
    loop_s = sum(r.get("timing/step_s", 0.0) for r in rows) + sum(r.get("timing/validation_s", 0.0) for r in rows if r["step"] == 0)
    kl = {k.rsplit("/", 1)[1]: [(r["step"], round(r[k], 4)) for r in rows if k in r] for k in sorted({k for r in rows for k in r if k.startswith("train/kl_teacher/")})}
    result = {
        "task": "arithmetic tiny (one-digit sums), 2048 train rows, 200 held-out eval rows, greedy accuracy",
        "teacher": {"parameters": count_parameters(models / "teacher-init"), **TEACHER,
                    "sft_val_accuracy": _val(_metrics(out, "teacher-sft")),
                    "grpo_val_accuracy": _val(_metrics(out, "teacher-grpo"))},
        "student": {"parameters": count_parameters(models / "student-init"), **STUDENT,
                    "warm_start_val_accuracy": _val(_metrics(out, "student-warm"))},
        "mopd": {"val_accuracy": val, "reverse_kl": kl, "steps": rows[-1]["step"],
                 "loop_s": loop_s, "run_wall_s": mopd.get("wall_s"), "stage_wall_s": mopd.get("stage_wall_s")},
        "teacher_accuracy": teacher_acc, "student_accuracy_before": student_start,
        "student_accuracy_after": student_end,
        "gap_closed_fraction": (student_end - student_start) / gap if gap > 0 else None,
        "within_budget": (mopd.get("wall_s") or 1e9) <= args.budget_s,
    }
    if control is not None:
        cval = _val(_metrics(out, "student-grpo-control"))
        result["grpo_control"] = {"val_accuracy": cval, "run_wall_s": control.get("wall_s"),
                                  "gap_closed_fraction": (cval[-1][1] - student_start) / gap if gap > 0 else None}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, args.plot)
    print(json.dumps({k: result[k] for k in ("teacher_accuracy", "student_accuracy_before", "student_accuracy_after",
                                             "gap_closed_fraction", "within_budget")}, indent=2))
    print(f"MOPD: {result['mopd']['steps']} steps, loop {loop_s:.0f} s, run {mopd.get('wall_s', 0):.0f} s")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for alias, series in result["mopd"]["reverse_kl"].items():
        xs, ys = [s for s, _ in series], [v for _, v in series]
        line, = a.plot(xs, ys, alpha=0.3)
        k = 25  # a trailing mean over k steps
        smooth = [sum(ys[max(0, i - k + 1):i + 1]) / len(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        a.plot(xs, smooth, color=line.get_color(), label=f"teacher {alias!r} ({k}-step mean)")
    a.set_xlabel("MOPD step")
    a.set_ylabel("KL(student || teacher) per token")
    a.set_title("reverse KL to each teacher (student samples)")
    a.legend()
    steps = [s for s, _ in result["mopd"]["val_accuracy"]]
    b.plot(steps, [v for _, v in result["mopd"]["val_accuracy"]], marker="o", label="student (MOPD)")
    if "grpo_control" in result:
        cv = result["grpo_control"]["val_accuracy"]
        b.plot([s for s, _ in cv], [v for _, v in cv], marker="s", color="tab:orange", label="student (GRPO, same samples)")
    b.axhline(result["teacher_accuracy"], color="k", linestyle="--", label="teacher")
    b.axhline(result["student_accuracy_before"], color="gray", linestyle=":", label="student before")
    b.set_ylim(0, 1.02)
    b.set_xlabel("step (64 student samples each)")
    b.set_ylabel("held-out accuracy (greedy)")
    b.set_title("held-out accuracy")
    b.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
