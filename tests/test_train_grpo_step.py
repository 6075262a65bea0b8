"""One GRPO step on a training worker in-process (no Ray): how many forward passes it runs, and that the
old-policy logprobs and token_mult_prob_error come from the right weights."""

from __future__ import annotations

import math

import pytest
import torch

from gymv.algorithms.loss_fns import PolicyLoss
from gymv.backends.logprobs import right_pad, sequence_logprobs
from gymv.cluster.workers import SEQ_ERRORS_KEY, TrainingWorker, WorkerSpec
from gymv.config import load_recipe
from gymv.config.schema import EnvSection, TrainingSection
from gymv.timing import PhaseTimer
from gymv.train.stats import policy_update
from conftest import REPO
from tiny_models import chat_ids, noise, tiny_path


def worker(micro_batch_tokens: int = 4096, kl_reference: bool = False) -> TrainingWorker:
    spec = WorkerSpec(model_path=str(tiny_path("tiny-llava")), env=EnvSection(name="circle-count"),
                      training=TrainingSection(lr=1e-2, weight_decay=0.01, dtype="float32",
                                               micro_batch_tokens=micro_batch_tokens), kl_reference=kl_reference)
    w = TrainingWorker(spec)
    w.setup()
    return w


def samples_for(w: TrainingWorker, n: int = 4, behaviour_shift: float = 0.0) -> list[dict]:
    """Prompt + a few completion tokens; behaviour logprobs are the worker's own (+ a shift)."""
    policy = w.backend.policy
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(n):
        image = noise(i // 2, (70, 60))
        prompt = chat_ids(policy, "How many?", [image])
        ids = prompt + [20 + i, 30 + i, 40 + i][: 1 + i % 3] + [im_end]
        mask = torch.tensor([0] * len(prompt) + [1] * (len(ids) - len(prompt)), dtype=torch.bool)
        batch = right_pad([ids], [[image]], policy.tokenizer.pad_token_id)
        with torch.no_grad():
            lp = sequence_logprobs(w.backend.model, policy.adapter, batch)[0]
        out.append({"input_ids": torch.tensor(ids), "loss_mask": mask,
                    "logp_behaviour": torch.where(mask, lp + behaviour_shift, torch.zeros_like(lp)),
                    "advantages": torch.tensor(1.0 if i % 2 else -1.0), "images": [image], "where": f"sample {i}"})
    return out


@pytest.fixture(autouse=True)
def tower_once_per_pass(monkeypatch):
    """The vision tower's calls count passes here, so each micro-batch encodes its own images (a step's images
    encoded once for all its micro-batches, gymv.backends.step_images, would hide the passes)."""
    from gymv.backends import step_images

    monkeypatch.setattr(step_images, "MAX_PIXEL_VALUES", 0)


def count_passes(model) -> list[int]:
    """Calls of the vision tower: one per pass over a micro-batch (every sample here has an image; a pass
    that shares prompts between samples calls the decoder twice, prompts then completions, but encodes once)."""
    calls: list[int] = []
    model.model.vision_tower.register_forward_hook(lambda mod, args, out: calls.append(1))
    return calls


def test_a_single_minibatch_step_runs_one_forward_pass_per_micro_batch():
    w = worker(micro_batch_tokens=160)  # about two samples per micro-batch
    samples = samples_for(w)
    calls = count_passes(w.backend.model)
    metrics = w.grpo_step([samples], PolicyLoss())
    assert metrics["train/num_micro_batches"] >= 2
    assert len(calls) == metrics["train/num_micro_batches"]
    assert all("logp_old" not in s for s in samples)


def test_token_mult_prob_error_of_a_single_minibatch_step_compares_the_training_forward_with_the_generator():
    w = worker()
    assert math.isclose(w.grpo_step([samples_for(w)], PolicyLoss())["train/token_mult_prob_error"], 1.0,
                        abs_tol=1e-5)
    shifted = w.grpo_step([samples_for(w, behaviour_shift=0.1)], PolicyLoss())
    assert math.isclose(shifted["train/token_mult_prob_error"], math.exp(0.1), rel_tol=1e-5)


def test_a_two_minibatch_step_scores_every_sample_under_the_old_weights_before_the_first_update():
    w = worker()
    samples = samples_for(w)
    before = samples_for(w)  # behaviour logprobs = the logprobs under the weights before the step
    calls = count_passes(w.backend.model)
    metrics = w.grpo_step([samples[:2], samples[2:]], PolicyLoss())
    # one no-grad pass over all four samples (one micro-batch) for the old logprobs, then one per minibatch
    assert metrics["train/num_micro_batches"] == 2 and len(calls) == 1 + 2
    for s, b in zip(samples, before):
        m = s["loss_mask"]
        assert torch.allclose(s["logp_old"][m], b["logp_behaviour"][m], atol=1e-5)


def test_without_a_threshold_nemo_rls_sequence_errors_come_from_the_training_forward_with_no_extra_pass():
    w = worker(micro_batch_tokens=160)
    samples = samples_for(w)
    for i, s in enumerate(samples):  # every generated token of sample i is 0.1 i off: e_s = exp(0.1 i)
        s["logp_behaviour"] = torch.where(s["loss_mask"], s["logp_behaviour"] + 0.1 * i, s["logp_behaviour"])
    cfg = load_recipe(REPO / "recipes" / "vlm_grpo.yaml", ["grpo.prompts_per_step=1", "grpo.generations_per_prompt=4",
                                                           "training.global_batch_size=4"]).validated
    calls = count_passes(w.backend.model)
    m = policy_update(w, cfg, samples, [1.0, 0.0, 1.0, 0.0], PolicyLoss(), None)
    assert len(calls) == m["train/num_micro_batches"] >= 2  # the training forward alone
    errors = [math.exp(0.1 * i) for i in range(4)]
    for suffix in ("", "_after_mask"):
        assert m[f"train/max_seq_mult_prob_error{suffix}"] == pytest.approx(max(errors), rel=1e-4)
        assert m[f"train/mean_seq_mult_prob_error{suffix}"] == pytest.approx(sum(errors) / 4, rel=1e-4)
        assert m[f"train/min_seq_mult_prob_error{suffix}"] == pytest.approx(1.0, rel=1e-4)
    assert (m["train/num_masked_seqs_by_logprob_error"], m["train/masked_correct_pct"]) == (0.0, 0.0)
    assert not any(k.startswith("train/seq_mult_prob_error") for k in m)


def test_a_step_left_without_samples_trains_on_nothing_and_logs_its_sequence_errors_as_0():
    """Every episode filtered (grpo.overlong_filtering): NeMo RL logs 0 where no sequence is left."""
    w = worker()
    before = {k: v.clone() for k, v in w.weights().items()}
    cfg = load_recipe(REPO / "recipes" / "vlm_grpo.yaml", ["grpo.prompts_per_step=1", "grpo.generations_per_prompt=4",
                                                           "training.global_batch_size=4"]).validated
    m = policy_update(w, cfg, [], [], PolicyLoss(), None)
    assert m["train/num_sequences"] == 0.0 and m["train/max_seq_mult_prob_error"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in w.weights().items())


def test_a_step_sends_its_phases_seconds_back_for_the_drivers_timer_the_reference_pass_inside_logprobs():
    w = worker(kl_reference=True)
    timer = PhaseTimer()
    metrics = timer.take(w.grpo_step([samples_for(w)], PolicyLoss(kl_coef=0.1)))
    assert not any(k.startswith("timing/") for k in metrics)
    assert set(timer.seconds) == {"logprobs", "reference", "training", "train_step"}
    assert 0.0 < timer.seconds["reference"] <= timer.seconds["logprobs"]
    assert 0.0 < timer.seconds["train_step"] <= timer.seconds["training"]


def test_the_training_worker_plans_micro_batches_that_keep_a_groups_samples_together():
    w = worker(micro_batch_tokens=160)  # room for one prompt and its completions, not two prompts
    samples = samples_for(w)  # samples 0 and 1 share a prompt and image, as do 2 and 3
    plan = w.backend.trainer._plan(samples)
    assert sorted(sorted(mb) for mb in plan) == [[0, 1], [2, 3]]


def test_a_step_takes_samples_whose_fields_are_plain_lists_as_it_takes_tensors():
    a, b = worker(), worker()
    tensors = samples_for(a)
    lists = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in tensors]
    want = a.grpo_step([tensors], PolicyLoss())
    got = b.grpo_step([lists], PolicyLoss())
    for k in ("train/loss", "train/grad_norm", "train/token_mult_prob_error", "train/num_tokens"):
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    assert all(torch.equal(x, y) for x, y in zip(a.weights().values(), b.weights().values()))


def test_a_sequence_over_the_logprob_error_threshold_trains_as_if_it_were_not_in_the_batch():
    masked, plain = worker(), worker()
    samples = samples_for(masked)
    off = samples[1]  # its generator logprobs 1 nat below the trainer's on every generated token: e_s = e > 2
    off["logp_behaviour"] = torch.where(off["loss_mask"], off["logp_behaviour"] - 1.0, off["logp_behaviour"])
    got = masked.grpo_step([samples], PolicyLoss(), seq_error_threshold=2.0)
    want = plain.grpo_step([[s for i, s in enumerate(samples_for(plain)) if i != 1]], PolicyLoss())
    errors = got.pop(SEQ_ERRORS_KEY)
    assert errors[1] == pytest.approx(math.e, rel=1e-5)
    assert all(e == pytest.approx(1.0, abs=1e-5) for e in errors[:1] + errors[2:])
    # nothing of it in the loss, the counts the loss divides by, or the gradient
    for k in ("train/loss", "train/num_sequences", "train/num_tokens", "train/token_mult_prob_error", "train/grad_norm"):
        assert got[k] == pytest.approx(want[k], rel=1e-5), k
    assert got["train/num_sequences"] == 3


def test_a_step_whose_every_sequence_is_masked_trains_nothing():
    w = worker()
    before = w.weights()
    metrics = w.grpo_step([samples_for(w, behaviour_shift=-1.0)], PolicyLoss(), seq_error_threshold=2.0)
    assert metrics["train/num_sequences"] == 0 and len(metrics[SEQ_ERRORS_KEY]) == 4
    assert all(torch.equal(before[k], v) for k, v in w.weights().items())
