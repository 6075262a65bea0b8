"""`gymv smoke --tiny` where vLLM imports: a recipe's vllm generation backend stays vllm (no stand-in), its
notes say so, and the tiny run it prepares trains on vLLM (with the recipe's megatron training backend where
megatron-core imports).

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from gymv.config import load_recipe  # noqa: E402
from gymv.smoke.plan import SmokeTarget, prepare_run  # noqa: E402
from gymv.smoke.tiny import megatron_runs_here  # noqa: E402
from train_helpers import ray_module  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).parent.parent.parent
RECIPE = REPO / "recipes/llm/grpo-qwen3-1.7b-1n8g-megatron.yaml"  # generation.backend: vllm


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


def test_tiny_keeps_the_vllm_generation_backend_and_its_run_trains_on_vllm(tmp_path):
    from gymv.train import train

    p = prepare_run(SmokeTarget(RECIPE), out_dir=tmp_path / "out", name="r", steps=1, tiny=True)
    cfg = load_recipe(p.config_file).validated
    assert cfg.generation.backend == "vllm"
    assert not any(c.startswith("generation.backend") for c in p.tiny_changes)
    assert "vLLM's CPU build as the vllm generation backend" in p.notes[0]
    # megatron-core installs with the dev extra, so the recipe's own training backend runs; else torch stands in
    assert cfg.training.backend == ("megatron" if megatron_runs_here() else "torch")
    summary = train(p.config_file)
    rows = [json.loads(x) for x in (p.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["complete"] and [r["step"] for r in rows] == [1]
    assert rows[0]["train/token_mult_prob_error"] < 1.05
