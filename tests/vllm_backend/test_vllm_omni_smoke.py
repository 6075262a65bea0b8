"""`gymv smoke --tiny` of a Nemotron 3 Omni recipe that generates (and scores teachers) with vLLM: vllm imports
here, but vLLM's CPU build cannot run the tiny stand-in's mixture-of-experts layers, so the tiny run generates
with hf and scores with torch teachers, and its notes say why (a vLLM recipe of another family keeps vLLM:
test_vllm_smoke.py).

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from gymv.backends.generation.vllm_models import refusal  # noqa: E402
from gymv.config import load_recipe  # noqa: E402
from gymv.smoke.plan import SmokeTarget, prepare_run  # noqa: E402
from gymv.smoke.tiny import VLLM_CPU_REFUSED  # noqa: E402
from tiny_models import tiny_path  # noqa: E402

REPO = Path(__file__).parent.parent.parent
RECIPE = REPO / "recipes/vlm/vlm_mopd-nemotron3-super-omni-10n8g-fsdp2-noncolocated.yaml"  # vllm everywhere


def test_tiny_generates_an_omni_vllm_recipe_with_hf_and_says_why(tmp_path):
    p = prepare_run(SmokeTarget(RECIPE), out_dir=tmp_path / "out", name="r", steps=1, tiny=True)
    cfg = load_recipe(p.config_file).validated
    assert cfg.model.path == "embedded:tiny-nemotron-omni"
    assert cfg.generation.backend == "hf" and {t.backend for t in cfg.mopd.teachers.values()} == {"torch"}
    assert "generation.backend: 'vllm' -> 'hf'" in p.tiny_changes
    assert any("cannot run tiny-nemotron-omni (its mixture-of-experts layers)" in n for n in p.notes)


def test_the_stand_ins_smoke_keeps_off_vllm_are_the_ones_vllm_refuses_on_cpu():
    for arch in VLLM_CPU_REFUSED:
        assert refusal(tiny_path(arch), "cpu", "bfloat16") is not None
    assert refusal(tiny_path("tiny-llava"), "cpu", "float32") is None
