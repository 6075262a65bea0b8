"""The trainer-facing loss functions: GRPO policy loss, SFT, MOPD distillation, with KL and IS options."""

import math

import pytest
import torch

from gymv.algorithms.grpo import policy_loss
from gymv.algorithms.loss_fns import DistillationLoss, ISConfig, PolicyLoss, SFTLoss
from gymv.algorithms.losses import GlobalCounts
from gymv.algorithms.mopd import mopd_loss
from gymv.config import load_recipe
from conftest import REPO

L = math.log
MASK = torch.tensor([[False, True, True]])


def batch(**extra):
    return {"loss_mask": MASK, "advantages": torch.tensor([2.0]), **extra}


def logp_of(*probs):
    return torch.log(torch.tensor([[1.0, *probs]])).requires_grad_()


def test_on_policy_loss_is_minus_mean_advantage_and_its_gradient_is_minus_a_over_tokens():
    logp = logp_of(0.5, 0.25)
    loss, metrics = PolicyLoss()(batch(), logp, None, GlobalCounts.of(MASK))
    loss.backward()
    assert loss.item() == pytest.approx(-2.0)
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.0, -1.0])
    assert metrics["clip_fraction"].item() == 0.0


def test_kl_penalty_adds_beta_times_k3():
    logp = logp_of(0.5, 0.5)
    ref = torch.log(torch.tensor([[1.0, 0.25, 0.5]]))
    loss, metrics = PolicyLoss(kl_coef=0.1)(batch(logp_ref=ref), logp, None, GlobalCounts.of(MASK))
    k3 = 0.5 + L(2) - 1  # first token; the second has ref == logp, k3 = 0
    assert metrics["kl_ref"].item() == pytest.approx(k3 / 2)
    assert loss.item() == pytest.approx(-2.0 + 0.1 * k3 / 2)


def test_the_kl_term_is_neither_weighted_nor_gated_by_importance_sampling():
    """NeMo RL adds beta * KL to the IS-weighted policy loss: L = mean(w * L_pg) + beta * mean(KL)."""
    logp = logp_of(0.5, 0.5)
    ref = torch.log(torch.tensor([[1.0, 0.25, 0.25]]))
    behaviour = torch.log(torch.tensor([[1.0, 0.125, 0.05]]))  # rho 4 (kept, w = 4) and 10 (dropped, w = 0)
    loss, metrics = PolicyLoss(kl_coef=0.1, importance=ISConfig("icepop", 0.2, 5.0))(
        batch(logp_ref=ref, logp_behaviour=behaviour), logp, None, GlobalCounts.of(MASK))
    k3 = 0.5 + L(2) - 1  # each token: ref 0.25 against 0.5
    assert metrics["kl_ref"].item() == pytest.approx(k3)
    assert loss.item() == pytest.approx(-(4 * 2) / 2 + 0.1 * (k3 + k3) / 2)


def test_kl_needs_reference_logprobs():
    with pytest.raises(RuntimeError, match="logp_ref"):
        PolicyLoss(kl_coef=0.1)(batch(), logp_of(0.5, 0.5), None, GlobalCounts.of(MASK))


def test_gate_removes_out_of_range_tokens_from_the_loss_but_not_the_denominator():
    logp = logp_of(0.5, 0.5)
    behaviour = torch.log(torch.tensor([[1.0, 0.5, 0.05]]))  # rho = 1 and 10
    loss, metrics = PolicyLoss(importance=ISConfig("icepop", 0.2, 5.0))(batch(logp_behaviour=behaviour), logp, None, GlobalCounts.of(MASK))
    assert loss.item() == pytest.approx(-1.0)  # one kept token of A=2, divided by 2 valid tokens
    assert metrics["is_oob_ratio"].item() == pytest.approx(0.5)


def test_icepop_weighs_the_tokens_inside_the_bounds_by_rho_and_zeroes_the_rest():
    """NeMo RL's icepop: w = rho on [min, max], 0 outside; rho 4 and 10 against the bounds 0.2 and 5."""
    logp = logp_of(0.5, 0.5)
    behaviour = torch.log(torch.tensor([[1.0, 0.125, 0.05]]))  # rho = 4 and 10
    loss, metrics = PolicyLoss(importance=ISConfig("icepop", 0.2, 5.0))(batch(logp_behaviour=behaviour), logp, None, GlobalCounts.of(MASK))
    loss.backward()
    assert loss.item() == pytest.approx(-(4 * 2) / 2)  # w * (-ratio * A) on the kept token, over 2 tokens
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -4.0, 0.0])
    assert metrics["is_weight_mean"].item() == pytest.approx(4 / 2)


def test_icepop_dropped_tokens_stay_in_their_sequences_token_mean():
    logp = logp_of(0.5, 0.5)
    behaviour = torch.log(torch.tensor([[1.0, 0.125, 0.05]]))  # rho = 4 and 10
    loss, _ = PolicyLoss(aggregation="seq_mean_token_mean", importance=ISConfig("icepop", 0.2, 5.0))(
        batch(logp_behaviour=behaviour), logp, None, GlobalCounts.of(MASK))
    assert loss.item() == pytest.approx(-(4 * 2 + 0) / 2)  # the sequence's mean over both of its tokens


def test_distillation_weighs_its_kept_tokens_by_rho():
    logp = logp_of(0.25, 0.5)
    teacher = torch.log(torch.tensor([[1.0, 0.5, 0.25]]))  # gaps +log2 and -log2
    behaviour = torch.log(torch.tensor([[1.0, 0.125, 0.01]]))  # rho 2 (kept) and 50 (dropped)
    loss, _ = DistillationLoss(importance=ISConfig("icepop", 0.2, 5.0))(
        {"loss_mask": MASK, "logp_teacher": teacher, "logp_behaviour": behaviour}, logp, None, GlobalCounts.of(MASK))
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -2 * L(2) / 2, 0.0])


def test_truncated_is_scales_each_token():
    logp = logp_of(0.5, 0.5)
    behaviour = torch.log(torch.tensor([[1.0, 0.25, 0.5]]))  # rho = 2 and 1
    loss, metrics = PolicyLoss(importance=ISConfig("truncated", 0.0, 1.5))(batch(logp_behaviour=behaviour), logp, None, GlobalCounts.of(MASK))
    assert loss.item() == pytest.approx(-(2 * 1.5 + 2 * 1.0) / 2)
    assert metrics["is_weight_max"].item() == pytest.approx(1.5)
    assert metrics["is_weight_mean"].item() == pytest.approx(1.25)


def test_truncated_is_raises_ratios_below_truncate_min_to_it():
    logp = logp_of(0.1, 0.5)
    behaviour = torch.log(torch.tensor([[1.0, 0.4, 0.125]]))  # rho = 0.25 and 4
    loss, _ = PolicyLoss(importance=ISConfig("truncated", 0.5, 2.0))(batch(logp_behaviour=behaviour), logp, None, GlobalCounts.of(MASK))
    assert loss.item() == pytest.approx(-(2 * 0.5 + 2 * 2.0) / 2)  # w = 0.5 and 2, A = 2, ratio 1


def test_seq_mask_tis_drops_whole_sequences_which_stay_in_the_token_count():
    mask = torch.tensor([[False, True, True], [False, True, True]])
    logp = torch.log(torch.full((2, 3), 0.5)).requires_grad_()
    behaviour = torch.log(torch.tensor([[1.0, 0.25, 1.0], [1.0, 0.25, 0.25]]))  # rho 2, 0.5 (kept); 2, 2 (dropped)
    b = {"loss_mask": mask, "advantages": torch.tensor([2.0, 1.0]), "logp_behaviour": behaviour}
    loss, _ = PolicyLoss(importance=ISConfig("seq_mask_tis", 0.999, 1.002))(b, logp, None, GlobalCounts.of(mask))
    loss.backward()
    assert loss.item() == pytest.approx(-(2 * 2.0 + 2 * 0.5) / 4)  # raw rho on the kept sequence, over 4 tokens
    assert logp.grad[1].tolist() == [0.0, 0.0, 0.0]


def test_is_oob_ratio_of_truncated_is_the_share_of_tokens_outside_the_clamp():
    logp = logp_of(0.1, 0.5)
    behaviour = torch.log(torch.tensor([[1.0, 0.4, 0.4]]))  # rho = 0.25 (below 0.5) and 1.25 (inside)
    _, metrics = PolicyLoss(importance=ISConfig("truncated", 0.5, 2.0))(batch(logp_behaviour=behaviour), logp, None, GlobalCounts.of(MASK))
    assert metrics["is_oob_ratio"].item() == pytest.approx(1 / 2)


def test_is_oob_ratio_of_seq_mask_tis_is_the_share_of_the_global_batchs_sequences_dropped():
    mask = torch.tensor([[False, True, True], [False, True, True]])
    behaviour = torch.log(torch.tensor([[1.0, 0.25, 1.0], [1.0, 0.25, 0.25]]))  # the second sequence is dropped
    b = {"loss_mask": mask, "advantages": torch.tensor([2.0, 1.0]), "logp_behaviour": behaviour}
    _, metrics = PolicyLoss(importance=ISConfig("seq_mask_tis", 0.999, 1.002))(
        b, torch.log(torch.full((2, 3), 0.5)), None, GlobalCounts(tokens=8.0, sequences=4.0))
    assert metrics["is_oob_ratio"].item() == pytest.approx(1 / 4)  # this micro-batch's share of 4 sequences


def test_the_recipes_seq_mask_tis_bounds_reach_the_loss():
    over = ["grpo.importance_sampling.kind=seq_mask_tis", "grpo.importance_sampling.gate_low=0.999",
            "grpo.importance_sampling.gate_high=1.002"]
    grpo = load_recipe(REPO / "recipes" / "grpo.yaml", over).validated.grpo
    assert policy_loss(grpo).importance == ISConfig("seq_mask_tis", 0.999, 1.002)


def test_the_recipes_truncate_min_reaches_the_loss():
    over = ["importance_sampling.kind=truncated", "importance_sampling.truncate_min=0.5"]
    grpo = load_recipe(REPO / "recipes" / "grpo.yaml", [f"grpo.{o}" for o in over]).validated.grpo
    mopd = load_recipe(REPO / "recipes" / "mopd.yaml", [f"mopd.{o}" for o in over]).validated.mopd
    assert policy_loss(grpo).importance == ISConfig("truncated", 0.5, 2.0)
    assert mopd_loss(mopd).distill.importance == ISConfig("truncated", 0.5, 2.0)


def test_behaviour_logprobs_yield_token_mult_prob_error_even_without_is():
    behaviour = torch.log(torch.tensor([[1.0, 0.25, 0.5]]))
    _, metrics = PolicyLoss()(batch(logp_behaviour=behaviour), logp_of(0.5, 0.5), None, GlobalCounts.of(MASK))
    assert metrics["token_mult_prob_error"].item() == pytest.approx(1.5)


def test_the_losses_log_each_sequences_logprob_error_as_a_share_and_its_extremes():
    mask = torch.tensor([[False, True, True], [False, True, True]])
    logp = torch.log(torch.full((2, 3), 0.5))
    behaviour = torch.log(torch.tensor([[1.0, 0.25, 0.5], [1.0, 0.5, 0.5]]))  # |gaps| log 2 and 0; 0 and 0
    b = {"loss_mask": mask, "advantages": torch.tensor([1.0, 1.0]), "logp_behaviour": behaviour}
    _, m = PolicyLoss()(b, logp, None, GlobalCounts(tokens=8.0, sequences=4.0))
    # e_s = (2 + 1) / 2 = 1.5 and 1; the mean is this micro-batch's share of 4 sequences
    assert m["seq_mult_prob_error_mean"].item() == pytest.approx((1.5 + 1.0) / 4)
    assert (m["seq_mult_prob_error_max"].item(), m["seq_mult_prob_error_min"].item()) == pytest.approx((1.5, 1.0))


def test_is_without_behaviour_logprobs_is_an_error():
    with pytest.raises(RuntimeError, match="logp_behaviour"):
        PolicyLoss(importance=ISConfig("truncated", 0.0, 2.0))(batch(), logp_of(0.5, 0.5), None, GlobalCounts.of(MASK))


def test_sft_loss_reports_nll_and_entropy():
    loss, metrics = SFTLoss()({"loss_mask": MASK}, logp_of(0.5, 0.25), torch.tensor([[9.0, 1.0, 3.0]]), GlobalCounts.of(MASK))
    assert loss.item() == pytest.approx((L(2) + L(4)) / 2)
    assert metrics["entropy"].item() == pytest.approx(2.0)


def test_distillation_pushes_logprobs_toward_the_teacher():
    logp = logp_of(0.25, 0.5)
    teacher = torch.log(torch.tensor([[1.0, 0.5, 0.25]]))  # gaps +log2 and -log2
    loss, metrics = DistillationLoss()({"loss_mask": MASK, "logp_teacher": teacher}, logp, None, GlobalCounts.of(MASK))
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -L(2) / 2, L(2) / 2])
    assert metrics["kl_teacher"].item() == pytest.approx(0.0)


def test_distillation_applies_the_same_gate():
    logp = logp_of(0.25, 0.5)
    teacher = torch.log(torch.tensor([[1.0, 0.5, 0.25]]))
    behaviour = torch.log(torch.tensor([[1.0, 0.25, 0.01]]))  # rho 1 and 50: second token gated
    loss, _ = DistillationLoss(importance=ISConfig("icepop", 0.2, 5.0))(
        {"loss_mask": MASK, "logp_teacher": teacher, "logp_behaviour": behaviour}, logp, None, GlobalCounts.of(MASK))
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -L(2) / 2, 0.0])


def test_a_null_truncate_max_weighs_each_token_by_its_raw_ratio():
    """NeMo RL with the correction on and no truncation type: w = rho, however large (rho = 0.25 and 4)."""
    grpo = load_recipe(REPO / "recipes" / "grpo.yaml", ["grpo.importance_sampling.kind=truncated",
                                                        "grpo.importance_sampling.truncate_max=null",
                                                        "grpo.loss.kl_coef=0"]).validated.grpo
    loss_fn = policy_loss(grpo)
    assert loss_fn.importance == ISConfig("truncated", 0.0, float("inf"))
    behaviour = torch.log(torch.tensor([[1.0, 0.4, 0.125]]))
    loss, metrics = loss_fn(batch(logp_behaviour=behaviour), logp_of(0.1, 0.5), None, GlobalCounts.of(MASK))
    assert loss.item() == pytest.approx(-(2 * 0.25 + 2 * 4.0) / 2)  # A = 2, ratio 1
    assert metrics["is_oob_ratio"].item() == 0.0


def test_distillation_bounds_the_teacher_advantage_where_asked():
    logp = logp_of(0.25, 0.5)
    teacher = torch.log(torch.tensor([[1.0, 1.0, 0.25]]))  # gaps +log4 and -log2
    loss, metrics = DistillationLoss(advantage_bounds=(-0.5, 1.0))(
        {"loss_mask": MASK, "logp_teacher": teacher}, logp, None, GlobalCounts.of(MASK))
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -1.0 / 2, 0.5 / 2])  # advantages 1.0 and -0.5
    assert metrics["teacher_advantage_clipped_fraction"].item() == pytest.approx(1.0)
    assert metrics["teacher_advantage_max"].item() == pytest.approx(1.0)


def test_a_bound_above_zero_leaves_the_tokens_off_the_mask_at_zero():
    logp = logp_of(0.5, 0.5)
    teacher = torch.log(torch.tensor([[1.0, 0.5, 0.5]]))  # gaps 0 and 0
    loss, _ = DistillationLoss(advantage_bounds=(0.25, None))(
        {"loss_mask": MASK, "logp_teacher": teacher}, logp, None, GlobalCounts.of(MASK))
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.25 / 2, -0.25 / 2])  # the prompt token stays out


def test_the_recipes_mopd_aggregation_and_bounds_reach_the_loss():
    over = ["mopd.loss.aggregation=seq_mean_token_mean", "mopd.advantage.clip_low=-50", "mopd.advantage.clip_high=50"]
    mopd = load_recipe(REPO / "recipes" / "mopd.yaml", over).validated.mopd
    loss = mopd_loss(mopd).distill
    assert loss.aggregation == "seq_mean_token_mean" and loss.advantage_bounds == (-50.0, 50.0)
    assert mopd_loss(load_recipe(REPO / "recipes" / "mopd.yaml").validated.mopd).distill.advantage_bounds is None


@pytest.mark.parametrize("extra, refused", [
    (["mopd.advantage.clip_low=5", "mopd.advantage.clip_high=-5"], "must be below clip_high"),
    (["mopd.advantage.clip_high=5", "mopd.top_k=4"], "top_k"),
    (["mopd.advantage.clip_high=5", "mopd.env_reward_coef=0.5"], "env_reward_coef"),
])
def test_bounds_the_loss_could_not_honour_are_refused_naming_why(extra, refused):
    from gymv.errors import GymvError

    with pytest.raises(GymvError, match=refused):
        load_recipe(REPO / "recipes" / "mopd.yaml", extra).validated
