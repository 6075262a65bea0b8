"""Refit checks without Ray: the digests are exact fingerprints, the comparisons name what differs, the probe is
a fixed natural-text sequence (around one image for a vision-language model), and an engine scores it as the
trainer does when both hold the same weights."""

from __future__ import annotations

import pytest
import torch

from gymv.backends.weights import tensor_digest, weight_digests
from gymv.cluster.refit_check import (
    CheckPlan,
    CheckRequest,
    build_probe,
    check_refit,
    digest_mismatch,
    engine_account,
    plan_checks,
    trainer_probe,
)
from gymv.config.schema import RefitCheckSection
from gymv.errors import GymvError


def test_equal_tensors_have_equal_digests_whatever_their_memory_layout():
    a = torch.randn(300, 70)
    assert tensor_digest(a) == tensor_digest(a.clone()) == tensor_digest(a.t().contiguous().t())


@pytest.mark.parametrize("method", ["sum", "sha256"])
@pytest.mark.parametrize("change", ["one element", "rows swapped", "transposed", "sign of zero", "reshaped"])
def test_any_change_of_bits_or_positions_changes_the_digest(change, method):
    a = torch.randn(64, 64)
    a[3, 3] = 0.0
    b = a.clone()
    if change == "one element":
        b[40, 7] = torch.nextafter(b[40, 7], torch.tensor(10.0))
    elif change == "rows swapped":
        b[[0, 1]] = b[[1, 0]]
    elif change == "transposed":
        b = b.t().contiguous()
    elif change == "sign of zero":
        b[3, 3] = -0.0
    else:
        b = b.reshape(32, 128)
    assert tensor_digest(a, method) != tensor_digest(b, method)


def test_a_change_past_the_first_row_of_words_is_seen():
    a = torch.randn(50_000)
    b = a.clone()
    b[33_000] += 1.0
    assert tensor_digest(a, "sum") != tensor_digest(b, "sum")


def test_a_digest_names_shape_dtype_and_method():
    assert tensor_digest(torch.zeros(2, 3, dtype=torch.bfloat16)).startswith("2x3:bfloat16:sha256:")
    assert tensor_digest(torch.tensor(1.0), "sum").startswith("scalar:float32:sum:")


@pytest.mark.parametrize("method", ["sum", "sha256"])
def test_both_methods_tell_tensors_apart_and_odd_byte_counts_too(method):
    a = torch.arange(7, dtype=torch.uint8)
    assert tensor_digest(a, method) != tensor_digest(a.flip(0), method)
    b = torch.randn(5, 3, dtype=torch.float64)
    assert tensor_digest(b, method) == tensor_digest(b.clone(), method) != tensor_digest(b * 2, method)


def test_digests_are_taken_in_the_dtype_sent_and_leave_integer_tensors_alone():
    w = {"w": torch.randn(8, 8), "steps": torch.arange(5)}
    d = weight_digests(w, torch.bfloat16)
    assert d["w"] == tensor_digest(w["w"].bfloat16()) and d["steps"] == tensor_digest(w["steps"])
    upcast = w["w"].bfloat16().float()  # an engine that keeps the layer wider holds the sent values exactly
    assert weight_digests({"w": upcast}, torch.bfloat16)["w"] == d["w"]


def test_a_gathering_trainers_first_refit_keeps_integer_buffers_in_their_own_dtype():
    from gymv.cluster.workers import held_for_first_refit

    trainer = {"w": torch.randn(4, 4), "vision_model.summary_idxs": torch.arange(3)}
    held = held_for_first_refit(trainer.items(), torch.bfloat16)
    assert held["w"].dtype == torch.bfloat16 and held["vision_model.summary_idxs"].dtype == torch.int64
    engine = {"w": trainer["w"].bfloat16(), "vision_model.summary_idxs": torch.arange(3)}  # as it loads them
    assert digest_mismatch(weight_digests(held, torch.bfloat16), weight_digests(engine, torch.bfloat16)) is None


def test_a_digest_mismatch_names_the_tensors_that_differ_and_those_not_held():
    sent = {n: tensor_digest(torch.full((2, 2), float(i))) for i, n in enumerate("abcdef")}
    held = {**sent, "b": tensor_digest(torch.zeros(2, 2) - 1), "c": tensor_digest(torch.zeros(4))}
    del held["f"]
    problem = digest_mismatch(sent, held)
    assert problem.startswith("2 of 6 tensors differ from what the trainer sent: b, c (1 in another shape or dtype: c)")
    assert problem.endswith("1 sent tensors are not held at all: f")
    assert digest_mismatch(sent, dict(sent)) is None


def test_a_failed_digest_check_is_one_line_naming_step_transport_worker_and_tensors():
    sent = {"model.w": tensor_digest(torch.ones(3))}
    with pytest.raises(GymvError) as e:
        check_refit(CheckRequest("digest", 4, "shm", version=12), {"digests": sent},
                    {"digests": {"model.w": tensor_digest(torch.zeros(3))}}, worker="generation worker 1")
    assert e.value.message.startswith("step 12's refit over shm: generation worker 1 does not hold the trainer's "
                                      "weights: 1 of 1 tensors differ from what the trainer sent: model.w")
    assert e.value.where == "refit.check" and e.value.exit_code == 1 and "\n" not in e.value.one_line()


def test_the_engines_initial_weights_are_named_as_such():
    with pytest.raises(GymvError, match="^refit.check: the engines' initial weights: generation worker 0 does not hold"):
        check_refit(CheckRequest("digest", 0, "shm"), {"digests": {"w": "1:float32:0"}}, {"digests": {}},
                    worker="generation worker 0")


def probe(refit: int, tolerance: float = 0.05) -> CheckRequest:
    return CheckRequest("probe", refit, "nccl", tolerance=tolerance, version=refit)


def test_a_probe_within_tolerance_passes_and_one_beyond_names_the_gap():
    check_refit(probe(1), {"probe": [-1.0, -2.0]}, {"probe": [-1.01, -2.01]}, worker="generation worker 0")
    with pytest.raises(GymvError, match=r"step 2's refit over nccl: .* 0\.5 nats per token away .*largest 0\.6; "
                                        r"tolerance 0\.05"):
        check_refit(probe(2), {"probe": [-1.0, -2.0]}, {"probe": [-1.4, -2.6]}, worker="generation worker 0")


def test_nan_probe_logprobs_fail_the_check():
    with pytest.raises(GymvError, match="inf nats"):
        check_refit(probe(1, 1.0), {"probe": [-1.0]}, {"probe": [float("nan")]}, worker="generation worker 0")


def test_an_engine_whose_probe_did_not_move_while_the_trainers_did_loaded_nothing():
    """Within the tolerance, but bit for bit the engine's previous answer while the trainer's logprobs moved."""
    before_trainer, before_engine = {"probe": [-1.0, -2.0]}, {"probe": [-1.001, -2.001]}
    now_trainer = {"probe": [-1.0005, -2.0005]}
    with pytest.raises(GymvError, match="exactly as after step 1 while the trainer's logprobs of it moved"):
        check_refit(probe(2), now_trainer, dict(before_engine), worker="generation worker 0",
                    previous=(1, before_trainer, before_engine))
    # a step that changed nothing (skipped) leaves both where they were: no error
    check_refit(probe(2), dict(before_trainer), dict(before_engine), worker="generation worker 0",
                previous=(1, before_trainer, before_engine))


def test_the_plan_checks_the_first_refits_then_every_nth():
    plan = CheckPlan("digest", RefitCheckSection(first=3, every=10))
    assert [r for r in range(0, 31) if plan.due(r)] == [0, 1, 2, 3, 10, 20, 30]
    assert not CheckPlan(None).due(0)
    assert [r for r in range(6) if CheckPlan("probe", RefitCheckSection(first=1, every=0)).due(r)] == [0, 1]


def test_auto_takes_the_backends_declared_check_and_the_tolerance_follows_the_dtype():
    section = RefitCheckSection()
    assert plan_checks(section, "digest", "bfloat16").kind == "digest"
    assert plan_checks(section, None, "bfloat16").kind is None
    assert plan_checks(RefitCheckSection(mode="probe"), "digest", "float32").kind == "probe"
    assert plan_checks(RefitCheckSection(mode="off"), "digest", "float32").kind is None
    assert plan_checks(section, "probe", "bfloat16").tolerance > plan_checks(section, "probe", "float32").tolerance
    assert plan_checks(RefitCheckSection(probe_tolerance=0.3), "probe", "float32").tolerance == 0.3


@pytest.fixture(scope="module")
def llava():
    from gymv.backends.policy import load_policy
    from tiny_models import tiny_path

    return load_policy(tiny_path("tiny-llava"))


def test_a_vision_language_probe_holds_one_image_and_scores_text_only(llava):
    probe = build_probe(llava.tokenizer, llava.adapter, 24)
    assert len(probe.images) == 1
    span = llava.adapter.image_token_ids(probe.images[0])
    image_at = [i for i, t in enumerate(probe.ids) if t == llava.adapter.image_token_id]
    assert len(image_at) == len(span) and len(probe.scored) == 24 - 1
    assert not set(probe.scored) & set(image_at) and 0 not in probe.scored
    assert build_probe(llava.tokenizer, llava.adapter, 24) == probe  # the same in every process


def test_a_text_model_probe_has_no_image():
    from gymv.backends.policy import load_policy
    from tiny_models import tiny_path

    policy = load_policy(tiny_path("tiny-qwen3"))
    probe = build_probe(policy.tokenizer, policy.adapter, 16)
    assert probe.images == () and len(probe.ids) == 16 and probe.scored == tuple(range(1, 16))


def test_the_hf_engine_scores_the_probe_as_the_trainer_does(llava):
    """Same weights, both float32: the engine's raw logprobs of the probe are the trainer's to float error, and
    the engine's digests are those of the trainer's state in the generation dtype."""
    from gymv.backends.generation.hf import HFGenerationBackend
    from gymv.backends.training.base import TrainingSetup
    from gymv.backends.training.hf_torch import HFTorchBackend
    from gymv.config.schema import TrainingSection
    from tiny_models import tiny_path

    trainer = HFTorchBackend.create(TrainingSetup(str(tiny_path("tiny-llava")), TrainingSection(), temperature=0.7),
                                    device="cpu")
    engine = HFGenerationBackend.from_policy(llava)
    probe = build_probe(trainer.tokenizer, trainer.adapter, 24)
    request = CheckRequest("probe", 1, "object_store", probe, 1e-4)
    ours, theirs = trainer_probe(trainer, probe), engine_account(engine, request, {}, "float32")["probe"]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4
    assert min(ours) < -1.0  # raw logprobs, not temperature 0.7's: the check compares the logits themselves
    sent = weight_digests(trainer.named_weights(), torch.bfloat16)
    assert engine_account(engine, CheckRequest("digest", 1), sent, "bfloat16")["digests"] == sent
    sent = weight_digests(trainer.named_weights(), torch.bfloat16, "sum")  # the engine answers in the trainer's method
    assert engine_account(engine, CheckRequest("digest", 1), sent, "bfloat16")["digests"] == sent


def test_a_bare_off_in_yaml_turns_the_check_off():
    import yaml

    assert RefitCheckSection.model_validate(yaml.safe_load("mode: off")).mode == "off"
    with pytest.raises(ValueError):
        RefitCheckSection.model_validate(yaml.safe_load("mode: on"))
