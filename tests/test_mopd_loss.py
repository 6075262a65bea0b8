"""The MOPD loss and its pieces: the environment-reward term, reward advantages and per-teacher reverse KL."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from gymv.algorithms.loss_fns import DistillationLoss, ISConfig
from gymv.algorithms.losses import GlobalCounts
from gymv.algorithms.mopd import MopdLoss, env_advantages, teacher_metrics


def _batch(seed=0, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, 3:] = True
    mask[2, 5:] = False
    logp = -torch.rand(B, T, generator=g) * 3
    return {
        "loss_mask": mask,
        "logp_teacher": -torch.rand(B, T, generator=g) * 3,
        "logp_behaviour": logp + 0.05 * torch.randn(B, T, generator=g),
        "advantages": torch.tensor([1.0, -0.5, 0.25]),
    }, logp


def _counts(batch):
    m = batch["loss_mask"]
    return GlobalCounts(tokens=float(m.sum()), sequences=float(m.any(-1).sum()))


@pytest.mark.parametrize("importance", [ISConfig(), ISConfig("icepop", 0.2, 5.0), ISConfig("truncated", 0.0, 1.02)])
def test_the_env_reward_term_equals_adding_c_times_the_reward_advantage_to_every_token(importance):
    batch, logp0 = _batch()
    c = 0.3
    distill = DistillationLoss(importance=importance)

    def grad(loss_fn, b):
        logp = logp0.clone().requires_grad_(True)
        loss, _ = loss_fn(b, logp, None, _counts(b))
        loss.backward()
        return loss.detach(), logp.grad

    # the same advantage written into the teacher logprobs: A_t = (teacher + c*A) - student
    shifted = {**batch, "logp_teacher": batch["logp_teacher"] + c * batch["advantages"][:, None]}
    want_loss, want_grad = grad(distill, shifted)
    got_loss, got_grad = grad(MopdLoss(distill, env_reward_coef=c), batch)
    torch.testing.assert_close(got_loss, want_loss)
    torch.testing.assert_close(got_grad, want_grad)


def test_without_the_env_term_the_loss_is_the_distillation_loss():
    batch, logp = _batch(1)
    a, ma = DistillationLoss()(batch, logp, None, _counts(batch))
    b, mb = MopdLoss(DistillationLoss(), 0.0)(batch, logp, None, _counts(batch))
    assert torch.equal(a, b) and "env_pg_loss" not in mb


def test_the_teacher_advantage_is_reported_as_its_token_mean_and_its_extremes():
    mask = torch.tensor([[False, True, True], [False, True, False]])
    student = torch.zeros(2, 3)
    teacher = torch.tensor([[9.0, -0.5, 0.25], [-9.0, 1.5, 7.0]])  # 9, -9 and 7 lie off the generated tokens
    batch = {"loss_mask": mask, "logp_teacher": teacher}
    _, m = DistillationLoss()(batch, student, None, GlobalCounts(tokens=3.0, sequences=2.0))
    assert m["teacher_advantage"].item() == pytest.approx((-0.5 + 0.25 + 1.5) / 3)
    assert (m["teacher_advantage_min"].item(), m["teacher_advantage_max"].item()) == (-0.5, 1.5)


def test_a_micro_batch_without_trained_tokens_leaves_the_extremes_to_the_others():
    batch = {"loss_mask": torch.zeros(1, 3, dtype=torch.bool), "logp_teacher": torch.ones(1, 3)}
    _, m = DistillationLoss()(batch, torch.zeros(1, 3), None, GlobalCounts(tokens=1.0, sequences=1.0))
    assert (m["teacher_advantage_max"].item(), m["teacher_advantage_min"].item()) == (-float("inf"), float("inf"))


@dataclass
class T:
    reward: float
    error: str | None = None
    logprobs: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)


def test_reward_advantages_leave_one_out_within_groups():
    trajs = [T(1.0), T(0.0), T(0.0), T(1.0), T(1.0), T(1.0)]
    assert env_advantages(trajs, 3) == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 0.0])


def test_reward_advantages_of_single_generations_use_the_batch_mean():
    assert env_advantages([T(1.0), T(0.0), T(0.0), T(1.0)], 1) == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_failed_episodes_get_no_reward_advantage_and_stay_out_of_baselines():
    trajs = [T(1.0), T(0.0, error="env down"), T(0.0)]
    assert env_advantages(trajs, 1) == pytest.approx([0.5, 0.0, -0.5])
    assert env_advantages(trajs, 3) == pytest.approx([1.0, 0.0, -1.0])


def test_reverse_kl_per_teacher_is_the_token_mean_of_student_minus_teacher_on_generated_tokens():
    a = T(0.0, logprobs=[0.0, -1.0, -2.0], loss_mask=[0, 1, 1])
    b = T(0.0, logprobs=[0.0, -0.5], loss_mask=[0, 1])
    c = T(0.0, logprobs=[0.0, -3.0], loss_mask=[0, 1])
    lp = [torch.tensor([5.0, -1.5, -1.0]), torch.tensor([0.0, -0.5]), torch.tensor([9.0, -1.0])]
    m = teacher_metrics([a, b, c], lp, ["count", "count", "arith"])
    assert m["train/kl_teacher/count"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert m["train/kl_teacher/arith"] == pytest.approx(-2.0)
    assert m["train/num_sequences/count"] == 2.0


def test_top_k_loss_is_the_cross_entropy_from_the_teachers_renormalised_candidates():
    from gymv.algorithms.loss_fns import topk_cross_entropy

    teacher = torch.log(torch.tensor([[[0.6, 0.2, 0.1]]]))  # renormalised: 2/3, 2/9, 1/9
    student = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    ce, kl = topk_cross_entropy(teacher, student)
    pt = torch.tensor([2 / 3, 2 / 9, 1 / 9])
    assert ce.item() == pytest.approx(float(-(pt * student[0, 0]).sum()), rel=1e-6)
    assert kl.item() == pytest.approx(float((pt * (pt.log() - student[0, 0])).sum()), rel=1e-6)


def test_a_top_k_step_moves_the_student_toward_the_teachers_candidates():
    batch, logp = _batch()
    B, T, k = logp.shape[0], logp.shape[1], 4
    g = torch.Generator().manual_seed(1)
    batch["teacher_topk_logp"] = torch.log_softmax(torch.randn(B, T, k, generator=g) * 3, -1)
    logits = torch.zeros(B, T, k, requires_grad=True)
    loss_fn = DistillationLoss(top_k=True)

    def step():
        return loss_fn(batch, logp, None, _counts(batch), candidates=torch.log_softmax(logits, -1))

    loss, m0 = step()
    loss.backward()
    with torch.no_grad():
        logits -= 5.0 * logits.grad
    _, m1 = step()
    assert m1["topk_kl"] < m0["topk_kl"]
    unmasked = ~batch["loss_mask"]
    assert torch.all(logits.grad[unmasked] == 0)  # positions the student did not generate give no gradient
