"""MOPD recipes: the shipped ones load and route, and the encoder-cache flag needs a transport that resets."""

from __future__ import annotations

from pathlib import Path

import pytest

from gymv.algorithms.mopd_routing import TeacherRouter
from gymv.backends.registry import REFIT_TRANSPORTS, TransportCapabilities
from gymv.config import load_recipe
from gymv.errors import GymvError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_the_smoke_recipe_runs_three_steps_with_the_cache_reset_on():
    cfg = load_recipe(RECIPES / "vlm/vlm_mopd-tinyllava-1n0g-torch-smoke.yaml").validated
    assert cfg.mopd.max_steps == 3 and cfg.generation.reset_encoder_cache_after_weight_update
    assert cfg.checkpoint.period == 3


def test_the_mixed_recipe_routes_images_and_text_to_their_own_teachers():
    cfg = load_recipe(RECIPES / "vlm/vlm_mopd-tinyllava-1n0g-torch-mixed.yaml").validated
    router = TeacherRouter.from_config(cfg.mopd)
    assert router.alias_for("circle_count_simple_agent") == "counting"
    assert router.alias_for("arithmetic_simple_agent") == "arith"
    assert cfg.mopd.teachers["arith"].path.startswith("text:") and cfg.mopd.teachers["arith"].data_parallel_size == 2


def test_the_encoder_cache_flag_with_a_transport_that_cannot_reset_is_a_load_time_error():
    REFIT_TRANSPORTS.register("mopd_no_reset", object, capabilities=TransportCapabilities(resets_encoder_cache=False))
    try:
        with pytest.raises(GymvError, match="reset_encoder_cache_after_weight_update") as e:
            load_recipe(RECIPES / "vlm/vlm_mopd-tinyllava-1n0g-torch-smoke.yaml", ["refit.transport=mopd_no_reset"])
        assert "mopd.yaml" in str(e.value.where)  # the line that turned the flag on (the exemplar's default)
    finally:
        REFIT_TRANSPORTS.unregister("mopd_no_reset")
