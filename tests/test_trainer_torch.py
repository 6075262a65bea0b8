"""TorchTrainer on a tiny GRU language model: micro-batching does not change the step, the reported loss and
gradient norm are the global-batch ones, non-finite losses stop the step, clipping, save/load."""

import pytest
import torch

from gymv.algorithms.loss_fns import PolicyLoss, SFTLoss
from gymv.algorithms.losses import GlobalCounts
from gymv.backends.training.micro_batches import pad_collate
from gymv.backends.training.torch_trainer import TorchTrainer
from gymv.errors import GymvError
from gymv.sections import TrainingSection
from tiny_lm import logprob_fn, make_samples, tiny_lm


def trainer(budget=10_000, **cfg):
    cfg = {"lr": 1e-2, "weight_decay": 0.0, **cfg}
    return TorchTrainer(tiny_lm(0), logprob_fn, TrainingSection(micro_batch_tokens=budget, **cfg))


def weights(t):
    return {k: v.clone() for k, v in t.state_dict().items()}


def assert_close(a, b, tol=1e-6):
    for k in a:
        assert torch.allclose(a[k], b[k], atol=tol, rtol=0), k


def test_token_budget_micro_batching_gives_the_same_step_as_one_batch():
    samples = make_samples(9, seed=1)
    whole, split = trainer(), trainer(budget=20)
    m1 = whole.train_step(samples, PolicyLoss())
    m2 = split.train_step(samples, PolicyLoss())
    assert m1["train/num_micro_batches"] == 1 and m2["train/num_micro_batches"] > 3
    assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-6)
    assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-5)
    assert_close(weights(whole), weights(split))


def test_reported_loss_and_grad_norm_are_those_of_the_whole_batch():
    samples = make_samples(6, seed=2)
    t = trainer(budget=16)
    model = tiny_lm(0)
    mb = pad_collate(samples)
    logp, ent = logprob_fn(model, mb)
    loss, _ = SFTLoss()(mb, logp, ent, GlobalCounts.of(mb["loss_mask"]))
    loss.backward()
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    m = t.train_step(samples, SFTLoss())
    assert m["train/loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    assert m["train/num_tokens"] == float(mb["loss_mask"].sum())


def test_a_nan_loss_raises_and_leaves_weights_and_optimizer_untouched():
    t = trainer(budget=16)
    t.train_step(make_samples(4, seed=3), PolicyLoss())
    before, opt_before = weights(t), {k: v["exp_avg"].clone() for k, v in enumerate(t.optimizer.state.values())}
    bad = make_samples(4, seed=4)
    bad[2]["advantages"] = torch.tensor(float("nan"))
    with pytest.raises(GymvError, match="non-finite loss"):
        t.train_step(bad, PolicyLoss())
    assert_close(before, weights(t), tol=0)
    assert all(torch.equal(opt_before[k], v["exp_avg"]) for k, v in enumerate(t.optimizer.state.values()))
    assert t.steps == 1


def test_gradients_are_clipped_to_max_grad_norm():
    # Adam's first update is lr * g / (|g| + eps); a huge eps makes it proportional to g, so clipping shows
    samples = make_samples(4, seed=5)
    free = trainer(lr=1e3, eps=1e3, max_grad_norm=None)
    start = weights(free)
    norm = free.train_step(samples, SFTLoss())["train/grad_norm"]
    clipped = trainer(lr=1e3, eps=1e3, max_grad_norm=norm / 4)
    clipped.train_step(samples, SFTLoss())
    ratio = [((weights(clipped)[k] - start[k]).norm() / (weights(free)[k] - start[k]).norm()).item() for k in start]
    assert ratio == pytest.approx([0.25] * len(ratio), rel=1e-3)


def test_compute_logprobs_match_an_unbatched_forward_in_input_order():
    samples = make_samples(5, seed=6)
    t = trainer(budget=20)
    out = t.compute_logprobs(samples)
    for s, lp in zip(samples, out):
        ref, _ = logprob_fn(t.model, {"input_ids": s["input_ids"][None]})
        assert lp.shape == s["input_ids"].shape
        assert torch.allclose(lp, ref[0], atol=1e-6)


def test_training_reduces_the_sft_loss():
    samples = make_samples(4, seed=7)
    t = trainer()
    first = t.train_step(samples, SFTLoss())["train/loss"]
    for _ in range(20):
        last = t.train_step(samples, SFTLoss())["train/loss"]
    assert last < first - 0.5


def test_save_and_load_restore_model_optimizer_and_step(tmp_path):
    samples = make_samples(4, seed=8)
    a = trainer()
    a.train_step(samples, PolicyLoss())
    a.save(tmp_path / "ckpt")
    b = TorchTrainer(tiny_lm(123), logprob_fn, a.config)
    b.load(tmp_path / "ckpt")
    assert b.steps == 1
    assert_close(weights(a), weights(b), tol=0)
    a.train_step(samples, PolicyLoss())
    b.train_step(samples, PolicyLoss())
    assert_close(weights(a), weights(b), tol=0)


def test_loading_weights_of_another_architecture_is_an_error(tmp_path):
    a = trainer()
    a.save(tmp_path / "ckpt")
    other = TorchTrainer(torch.nn.Linear(3, 3), logprob_fn)
    with pytest.raises(GymvError, match="does not match"):
        other.load(tmp_path / "ckpt")


def test_bf16_without_cuda_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(GymvError, match="bf16"):
        trainer(dtype="bfloat16")


@pytest.mark.gpu
def test_bf16_autocast_on_cuda_trains_with_fp32_master_weights_and_logprobs():
    t = TorchTrainer(tiny_lm(0), logprob_fn, TrainingSection(lr=1e-2, dtype="auto"), device="cuda")
    assert t.autocast_dtype == torch.bfloat16
    samples = make_samples(4, seed=9)
    first = t.train_step(samples, SFTLoss())["train/loss"]
    for _ in range(10):
        last = t.train_step(samples, SFTLoss())["train/loss"]
    assert last < first
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    assert t.compute_logprobs(samples)[0].dtype == torch.float32
