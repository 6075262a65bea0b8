"""The quickstart with `generation.backend=vllm`: the quickstart's model, data and SFT warm start, then its GRPO
recipe through `gymv train` with vLLM generating (rollouts and held-out validation); held-out accuracy rises.
Fewer GRPO steps and held-out rows than the quickstart (100 steps, 128 rows) so that it fits in CI.

At this scale one validation swings by 10-30 points between neighbouring checkpoints, and where a run lands
at a given step depends on the machine's float path (its CPU's kernels): an assertion on the last
validation alone failed on one machine at 55.5% -> 61.7% while it passed on others at 55.5% -> 92.2%.
So learning is judged on smoothed measures: the train reward of the last 20 steps against the first 20
(1280 samples each), and the mean of the validations at steps 50, 75 and 100 against the start.

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import json
from statistics import mean

import pytest

pytest.importorskip("vllm")

from gymv.train import train  # noqa: E402
from learning import assert_learns  # noqa: E402
from train_helpers import ray_module, write_recipe  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


@pytest.mark.timeout(1200)
def test_the_quickstart_recipe_learns_with_vllm_generation(tmp_path):
    from gymv.data.generate import write_dataset
    from gymv.envs import get_env
    from gymv.envs.knobs import resolve_knobs
    from gymv.models.tiny import init_tiny

    env = get_env("circle-count")
    knobs = resolve_knobs(env, "tiny", ["radius=9"])  # the quickstart's data
    write_dataset(tmp_path / "train.jsonl", env, knobs, n=4096, split="train", seed=0)
    write_dataset(tmp_path / "eval.jsonl", env, knobs, n=128, split="eval", seed=0)
    data = {"data.train": str(tmp_path / "train.jsonl"), "data.eval": str(tmp_path / "eval.jsonl"),
            "data.prepare": None, "checkpoint.dir": str(tmp_path / "runs"), "cluster.ray_address": None}
    model = init_tiny("tiny-llava", tmp_path / "model", layers=1, vision_layers=1)  # the quickstart's model
    train(write_recipe(tmp_path, "sft", "vlm/vlm_sft-tinyllava-1n0g-torch.yaml",
                       {**data, "model.path": str(model), "sft.val_period": 0}))
    train(write_recipe(tmp_path, "grpo", "vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", {
        **data, "model.path": str(tmp_path / "runs" / "sft" / "final"), "generation.backend": "vllm",
        "grpo.max_steps": 100, "grpo.val_period": 25, "grpo.val_prompts": 128, "grpo.val_at_start": True,
        "checkpoint.period": 100}))
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    val = [m["val/accuracy"] for m in metrics if "val/accuracy" in m]
    reward = [m["train/reward_mean"] for m in metrics if "train/reward_mean" in m]
    err = max(m["train/token_mult_prob_error"] for m in metrics if "train/token_mult_prob_error" in m)
    print(f"held-out accuracy {val[0]:.3f} -> {' '.join(f'{v:.3f}' for v in val[1:])} (steps 25-100); train "
          f"reward {mean(reward[:20]):.3f} -> {mean(reward[-20:]):.3f} (first and last 20 steps); "
          f"max token_mult_prob_error {err:.5f}")
    assert len(val) == 5 and len(reward) == 100, (val, len(reward))
    assert_learns(reward, val, window=20, later_from=2)  # validations at steps 50-100 against the start
    assert err < 1.05  # every step on-policy: the engine's logprobs are the trainer's after each refit
