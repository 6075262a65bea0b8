"""bench/gpu_nemotron_omni.py on a CPU at tiny widths: the rows the GPU runs report (layer paths with their
operator profiles, the tower's host and device times, the trainer's profile and optimizer floor) are produced
by the same code, so a broken bench shows here rather than on a lent GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_nemotron_omni.py"
pytestmark = pytest.mark.slow


def _bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--out", str(tmp_path / "work"),
                           "--json", str(out), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_layers_part_times_the_moe_paths_and_the_tower_with_operator_profiles(tmp_path):
    got = _bench(tmp_path, "--part", "layers", "--layer-kinds", "moe,vision", "--layer-tokens", "256",
                 "--layer-reps", "1", "--vision-paths", "eager,eager_no_ckpt")
    rows = got["layers"]
    moe = {(r["layer"], r["path"]): r for r in rows if r["layer"].startswith("moe")}
    assert set(moe) == {(k, p) for k in ("moe", "moe_experts") for p in ("hf_eager", "hf_grouped_mm", "gymv_torch", "gymv", "gymv_first_micro_batch")}
    assert all(r["ms"] > 0 for r in moe.values())
    assert moe["moe", "gymv"]["top_ops"] and moe["moe", "gymv"]["top_ops"][0]["self_ms"] > 0
    vision = [r for r in rows if r["layer"] == "vision"]
    assert [(r["path"], r["images"]) for r in vision] == [("eager", 1), ("eager", 4), ("eager_no_ckpt", 1),
                                                          ("eager_no_ckpt", 4)]
    assert all(r["ms"] > 0 and r["host_ms"] > 0 and r["tokens"] > 0 for r in vision)
    assert all(bool(r.get("top_ops")) == (r["images"] == 4) for r in vision)


def test_the_profiled_trainer_rows_one_a_backend_split_the_step_by_kind_and_list_its_operators(tmp_path):
    got = _bench(tmp_path, "--part", "train", "--train-paths", "gymv", "--train-layers", "3", "--steps", "1",
                 "--profile", "--backend", "fsdp2,torch")
    assert [(r["backend"], "error" in r) for r in got["train"]] == [("fsdp2", False), ("torch", False)], got["train"]
    row = got["train"][0]
    prof = row["profile_s_by_kind"]
    assert prof["step_s"] > 0 and {"vision/forward", "moe/forward", "mamba/forward"} <= set(prof)
    assert prof["top_ops"] and all(o["calls"] > 0 for o in prof["top_ops"])
    assert row["optimizer_floor_s"] is None  # the card's bandwidth bounds it; a CPU has none to state
    assert row["shared_prompts"] is True


def test_whole_rows_repeat_each_groups_prompt_and_say_so(tmp_path):
    rows = [_bench(tmp_path, "--part", "train", "--train-layers", "3", "--steps", "1", *extra)["train"][0]
            for extra in ((), ("--whole-rows",))]
    assert [r["shared_prompts"] for r in rows] == [True, False]
    assert rows[0]["tokens"] == rows[1]["tokens"] and rows[0]["unique_tokens"] < rows[0]["tokens"]
