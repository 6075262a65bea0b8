"""Sequence-level logprob-error masking (`seq_logprob_error_threshold`): the per-sequence error, which
sequences it masks and NeMo RL's eight figures, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gymv.algorithms.seq_error import (
    batch_errors,
    drop_masked_samples,
    seq_error_metrics,
    sequence_mult_prob_error,
    unmasked_metrics,
)
from gymv.errors import GymvError


def test_the_sequence_error_is_the_mean_of_exp_abs_gap_over_the_generated_tokens_only():
    behaviour = torch.tensor([-9.0, -1.0, -2.0, 0.0])
    old = torch.tensor([0.0, -1.5, -1.0, -7.0])
    mask = torch.tensor([False, True, True, False])
    # |gaps| on the two generated tokens: 0.5 and 1.0 (the prompt's -9 and the padding's 7 do not count)
    assert sequence_mult_prob_error(behaviour, old, mask) == pytest.approx((math.exp(0.5) + math.e) / 2)


def test_a_sequence_without_generated_tokens_has_no_error():
    assert sequence_mult_prob_error(torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.bool)) is None


def test_a_micro_batchs_errors_are_each_sequences_error_and_whether_it_has_generated_tokens():
    behaviour = torch.tensor([[-9.0, -1.0, -2.0], [0.0, 0.0, 0.0]])
    old = torch.tensor([[0.0, -1.5, -1.0], [5.0, 5.0, 5.0]])
    errors, has = batch_errors(behaviour, old, torch.tensor([[False, True, True], [False, False, False]]))
    assert errors.tolist() == pytest.approx([(math.exp(0.5) + math.e) / 2, 1.0])
    assert has.tolist() == [True, False]


def test_without_a_threshold_the_losses_statistics_become_nemo_rls_eight_figures():
    m = unmasked_metrics({"seq_mult_prob_error_max": 2.5, "seq_mult_prob_error_mean": 1.75,
                          "seq_mult_prob_error_min": 1.0})
    assert m == {"train/max_seq_mult_prob_error": 2.5, "train/mean_seq_mult_prob_error": 1.75,
                 "train/min_seq_mult_prob_error": 1.0, "train/max_seq_mult_prob_error_after_mask": 2.5,
                 "train/mean_seq_mult_prob_error_after_mask": 1.75, "train/min_seq_mult_prob_error_after_mask": 1.0,
                 "train/num_masked_seqs_by_logprob_error": 0.0, "train/masked_correct_pct": 0.0}


def test_without_a_sequence_to_take_them_over_the_extremes_are_0():
    m = unmasked_metrics({"seq_mult_prob_error_max": -math.inf, "seq_mult_prob_error_mean": 0.0,
                          "seq_mult_prob_error_min": math.inf})
    assert (m["train/max_seq_mult_prob_error"], m["train/min_seq_mult_prob_error"]) == (0.0, 0.0)


def test_the_eight_figures_of_a_batch_with_one_sequence_over_the_threshold():
    m = seq_error_metrics([1.0, 2.5, 1.5, None], rewards=[1.0, 1.0, 0.0, 0.0], threshold=2.0)
    assert m == pytest.approx({
        "train/max_seq_mult_prob_error": 2.5, "train/mean_seq_mult_prob_error": 5.0 / 3,
        "train/min_seq_mult_prob_error": 1.0,
        "train/max_seq_mult_prob_error_after_mask": 1.5, "train/mean_seq_mult_prob_error_after_mask": 1.25,
        "train/min_seq_mult_prob_error_after_mask": 1.0,
        "train/num_masked_seqs_by_logprob_error": 1.0, "train/masked_correct_pct": 1.0})


def test_an_error_equal_to_the_threshold_is_kept():
    m = seq_error_metrics([2.0, 3.0], rewards=[0.0, 0.5], threshold=2.0)
    assert m["train/num_masked_seqs_by_logprob_error"] == 1.0 and m["train/max_seq_mult_prob_error_after_mask"] == 2.0
    assert m["train/masked_correct_pct"] == 0.0  # the masked one earned 0.5: only a reward of exactly 1 counts


def test_without_a_threshold_nothing_is_masked_and_the_after_figures_equal_the_before_ones():
    m = seq_error_metrics([1.25, 4.0], rewards=[1.0, 0.0], threshold=None)
    assert m["train/num_masked_seqs_by_logprob_error"] == 0.0 and m["train/masked_correct_pct"] == 0.0
    for stat in ("max", "mean", "min"):
        assert m[f"train/{stat}_seq_mult_prob_error_after_mask"] == m[f"train/{stat}_seq_mult_prob_error"]


def test_a_batch_masked_entirely_reports_zero_after_masking():
    m = seq_error_metrics([3.0, 5.0], rewards=[1.0, 0.0], threshold=2.0)
    assert m["train/num_masked_seqs_by_logprob_error"] == 2.0 and m["train/masked_correct_pct"] == 0.5
    assert [m[f"train/{s}_seq_mult_prob_error_after_mask"] for s in ("max", "mean", "min")] == [0.0, 0.0, 0.0]


def sample(gap: float, tokens: int = 2) -> dict:
    mask = torch.tensor([False] + [True] * tokens)
    return {"loss_mask": mask, "logp_old": torch.zeros(tokens + 1),
            "logp_behaviour": torch.where(mask, torch.full((tokens + 1,), -gap), torch.zeros(tokens + 1))}


def test_dropping_keeps_each_minibatch_and_reports_every_samples_error_in_order():
    a, b, c = sample(0.1), sample(1.0), sample(0.0)
    kept, errors = drop_masked_samples([[a, b], [c]], threshold=2.0)
    assert kept == [[a], [c]]  # exp(1.0) = 2.72 > 2: b goes; the minibatches stay two
    assert errors == pytest.approx([math.exp(0.1), math.e, 1.0])


def test_a_sample_without_generator_logprobs_cannot_be_judged():
    s = sample(0.0)
    del s["logp_behaviour"]
    s["where"] = "row 3 sample 1"
    with pytest.raises(GymvError, match="row 3 sample 1 has no generator logprobs") as e:
        drop_masked_samples([[s]], threshold=2.0)
    assert e.value.where == "seq_logprob_error_threshold"


def test_the_errors_of_several_training_ranks_come_back_in_sample_order():
    from gymv.cluster.group import shard_minibatches, unshard

    minibatches = [list(range(5)), list(range(5, 8))]
    shards = shard_minibatches(minibatches, 3)  # rank r scores its parts of both minibatches, in order
    per_rank = [[x * 10 for part in parts for x in part] for parts in shards]
    assert unshard(shards, per_rank) == [x * 10 for x in range(8)]


def _step(masked: int, kept: int) -> dict:
    return {"train/num_masked_seqs_by_logprob_error": float(masked), "train/num_sequences": float(kept),
            "train/min_seq_mult_prob_error": 1.0004}


def test_a_step_whose_every_sequence_is_masked_is_a_warning_naming_the_step_and_the_threshold():
    from gymv.algorithms.seq_error import AllMaskedWatch

    said = []
    watch = AllMaskedWatch(1.0, "grpo.seq_logprob_error_threshold", said.append)
    watch.check(1, _step(masked=15, kept=1))  # one sequence trained: no warning
    watch.check(2, _step(masked=16, kept=0))
    assert said == ["warning: step 2: grpo.seq_logprob_error_threshold 1 masked all 16 sequences; the smallest "
                    "sequence error was 1.0004, so the step trained on nothing (the run stops after 3 such steps in "
                    "a row)"]


def test_every_sequence_masked_on_three_steps_in_a_row_stops_the_run_naming_the_key():
    from gymv.algorithms.seq_error import AllMaskedWatch

    said = []
    watch = AllMaskedWatch(1.0, "mopd.seq_logprob_error_threshold", said.append)
    watch.check(1, _step(16, 0))
    watch.check(2, _step(16, 0))
    watch.check(3, _step(3, 13))  # a step that trained on something starts the count again
    watch.check(4, _step(16, 0))
    watch.check(5, _step(16, 0))
    with pytest.raises(GymvError, match=r"mopd.seq_logprob_error_threshold 1 masked every sequence of the last 3 "
                                        r"steps \(to step 6") as err:
        watch.check(6, _step(16, 0))
    assert err.value.where == "mopd.seq_logprob_error_threshold" and "null" in err.value.fix
    assert len(said) == 4 and err.value.exit_code == 1


def test_without_a_threshold_or_without_masking_nothing_is_said():
    from gymv.algorithms.seq_error import AllMaskedWatch

    said = []
    for watch in (AllMaskedWatch(None, "grpo.seq_logprob_error_threshold", said.append),
                  AllMaskedWatch(2.0, "grpo.seq_logprob_error_threshold", said.append)):
        for step in range(1, 5):
            watch.check(step, {"train/num_sequences": 0.0} if watch.threshold is None else _step(0, 16))
    assert said == []
