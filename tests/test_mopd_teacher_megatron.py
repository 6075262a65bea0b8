"""The megatron teacher (Megatron-core's twin of the checkpoint, scoring only) scores row-aligned batches
exactly as the torch teacher does: a mixed batch of image and text rows, a text-only cut of a VLM, top-k
candidates; float32 on the CPU, one rank (tensor-parallel ranks: tests/test_mopd_train_megatron.py), and a
replica of two gloo ranks of tensor x expert parallel size 2 x 2 on the tiny Nemotron 3 Omni."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

pytest.importorskip("megatron.core")

from gymv.algorithms.teacher_batch import TeacherRow  # noqa: E402
from gymv.backends.registry import TEACHER_BACKENDS  # noqa: E402
from gymv.backends.teacher import TeacherModel  # noqa: E402
from gymv.backends.teacher_spec import TeacherSpec  # noqa: E402
from gymv.errors import GymvError  # noqa: E402
from gymv.sections import TeacherSection  # noqa: E402
from tiny_models import chat_ids, noise, shared_policy, tiny_path  # noqa: E402


def _rows() -> list[TeacherRow]:
    """Image row, text row, image row (another image, another length), text row."""
    p = shared_policy("tiny-llava")
    g = torch.Generator().manual_seed(3)

    def gen(k):
        return torch.randint(10, 200, (k,), generator=g).tolist()

    a, b = noise(1), noise(2, size=(40, 70))
    return [TeacherRow(chat_ids(p, "How many red circles?", [a]) + gen(5), [a], "row 0"),
            TeacherRow(chat_ids(p, "3 + 4=?", []) + gen(9), [], "row 1"),
            TeacherRow(chat_ids(p, "Count the blue ones.", [b]) + gen(3), [b], "row 2"),
            TeacherRow(chat_ids(p, "7 + 1=?", []) + gen(2), [], "row 3")]


def _spec(expert_parallel_size: int = 1, **kw) -> TeacherSpec:
    llava = str(tiny_path("tiny-llava"))
    section = TeacherSection(path=llava, backend="megatron", expert_parallel_size=expert_parallel_size)
    return TeacherSpec("count", llava, llava, temperature=0.7, section=section, **kw)


@lru_cache(maxsize=None)
def _teachers(text_of: bool = False, top_k: int = 0):
    spec = _spec(text_of=text_of, top_k=top_k)
    return TEACHER_BACKENDS.load("megatron")(spec), TeacherModel(spec)


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, dict):
            assert torch.equal(g["topk_ids"], w["topk_ids"])
            torch.testing.assert_close(g["topk_logp"], w["topk_logp"], rtol=0, atol=2e-5)
            g, w = g["logp"], w["logp"]
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=2e-5)


def test_a_megatron_teacher_scores_a_mixed_image_batch_as_the_torch_teacher():
    megatron, hf = _teachers()
    rows = _rows()
    scores = megatron.score(rows)
    _assert_same(scores, hf.score(rows))
    assert all(s[1:].ne(0).any() for s in scores)  # real scores, not a zeroed row


def test_a_megatron_teacher_scores_each_row_with_its_own_images():
    megatron, _ = _teachers()
    rows = _rows()
    swapped = TeacherRow(rows[0].input_ids, rows[2].images, "row 0 with row 2's image")
    assert not torch.allclose(megatron.score([swapped])[0], megatron.score(rows[:1])[0])


def test_the_text_cut_of_a_vlm_scores_text_rows_as_the_torch_teachers_cut():
    megatron, hf = _teachers(text_of=True)
    rows = [r for r in _rows() if not r.images]
    assert megatron.text_only and not megatron.model.gpt.config.tensor_model_parallel_size > 1
    _assert_same(megatron.score(rows), hf.score(rows))


def test_top_k_candidates_are_the_torch_teachers():
    megatron, hf = _teachers(top_k=3)
    rows = _rows()
    _assert_same(megatron.score(rows), hf.score(rows))


def test_the_teacher_holds_a_megatron_model_with_no_trainable_weights_and_counts_the_checkpoints_parameters():
    megatron, hf = _teachers()
    assert type(megatron.model).__name__ == "MegatronVLM"
    assert not any(p.requires_grad for p in megatron.model.parameters())
    assert megatron.num_parameters() == sum(p.numel() for p in hf.model.parameters())


def test_an_expert_parallel_size_not_dividing_the_tensor_parallel_size_is_refused_naming_the_key():
    with pytest.raises(GymvError) as e:
        TEACHER_BACKENDS.load("megatron")(_spec(expert_parallel_size=2))  # TP 1: one rank, two expert shares
    assert e.value.where == "mopd.teachers.count.expert_parallel_size" and "divisor of 1" in e.value.fix


def test_expert_parallelism_on_a_decoder_without_moe_layers_is_refused_naming_the_key():
    llava = str(tiny_path("tiny-llava"))
    section = TeacherSection(path=llava, backend="megatron", tensor_parallel_size=2, expert_parallel_size=2)
    with pytest.raises(GymvError) as e:  # refused before any process group is asked for
        TEACHER_BACKENDS.load("megatron")(TeacherSpec("count", llava, llava, section=section))
    assert e.value.where == "mopd.teachers.count.expert_parallel_size" and "expert_parallel_size: 1" in e.value.fix


def _omni_rows() -> list[TeacherRow]:
    p = shared_policy("tiny-nemotron-omni")
    g = torch.Generator().manual_seed(5)

    def gen(k):
        return torch.randint(10, 200, (k,), generator=g).tolist()

    a, b = noise(1, size=(48, 64)), noise(2, size=(40, 40))
    return [TeacherRow(chat_ids(p, "How many red circles?", [a]) + gen(6), [a], "row 0"),
            TeacherRow(chat_ids(p, "3 + 4=?", []) + gen(4), [], "row 1"),
            TeacherRow(chat_ids(p, "Count the blue ones.", [b]) + gen(3), [b], "row 2")]


def test_a_megatron_teacher_of_nemotron_3_omni_scores_image_rows_as_the_torch_teacher():
    """Mamba-2, attention and MoE layers in gymv's Megatron hybrid model, the RADIO tower beside it."""
    omni = str(tiny_path("tiny-nemotron-omni"))
    spec = TeacherSpec("self", omni, omni, section=TeacherSection(path=omni, backend="megatron"))
    megatron, hf = TEACHER_BACKENDS.load("megatron")(spec), TeacherModel(spec)
    assert type(megatron.model.gpt).__name__ == "HybridModel"
    rows = _omni_rows()
    scores = megatron.score(rows)
    _assert_same(scores, hf.score(rows))
    assert all(s[1:].ne(0).any() for s in scores)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["tiny-llava", "tiny-nemotron-omni"])
def test_on_cuda_in_bfloat16_a_megatron_teacher_scores_as_the_torch_teacher_within_bf16_error(arch):
    path = str(tiny_path(arch))
    spec = TeacherSpec("t", path, path, device="cuda", dtype="bfloat16",
                       section=TeacherSection(path=path, backend="megatron"))
    megatron, hf = TEACHER_BACKENDS.load("megatron")(spec), TeacherModel(spec)
    rows = _rows() if arch == "tiny-llava" else _omni_rows()
    for g, w in zip(megatron.score(rows), hf.score(rows)):
        assert g.shape == w.shape and (g - w).abs().max() < 0.05


def _omni_spec(omni: str, device: str = "cpu", dtype: str = "float32", **section) -> TeacherSpec:
    return TeacherSpec("self", omni, omni, temperature=0.7, top_k=3, device=device, dtype=dtype,
                       section=TeacherSection(path=omni, backend="megatron", **section))


def _on_cpu(scores: list) -> list:
    return [{k: v.cpu() for k, v in s.items()} if isinstance(s, dict) else s.cpu() for s in scores]


def _ep_rank(rank: int, world: int, port: int, omni: str, rows: list[TeacherRow], device: str = "cpu",
             dtype: str = "float32") -> dict:
    """One rank of a TP 2 x EP 2 teacher replica, its process group up as gymv.cluster.teachers joins it
    (gloo on the CPU, nccl on GPUs)."""
    import datetime

    import torch.distributed as dist

    from gymv.backends.training.megatron_model import release_parallel
    from gymv.backends.training.process_group import leave_process_group

    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(minutes=2))
    try:
        spec = _omni_spec(omni, device, dtype, tensor_parallel_size=world, expert_parallel_size=world)
        teacher = TEACHER_BACKENDS.load("megatron")(spec)
        experts = {k: len(p) for k, p in teacher.model.named_parameters() if ".mixer.experts." in k}  # [expert, ...]
        return {"scores": _on_cpu(teacher.score(rows)), "alone": _on_cpu(teacher.score(rows[2:])),
                "experts": experts, "parameters": teacher.num_parameters()}
    finally:
        release_parallel()
        leave_process_group()


@pytest.fixture(scope="module")
def ep_ranks():
    from megatron_helpers import spawn_ranks

    omni = str(tiny_path("tiny-nemotron-omni"))
    return spawn_ranks(_ep_rank, 2, omni, _omni_rows()), TeacherModel(_omni_spec(omni))


@pytest.mark.slow
def test_a_tp2_ep2_teacher_of_nemotron_3_omni_scores_image_rows_and_top_k_as_the_torch_teacher(ep_ranks):
    """Two gloo ranks, the experts split between them and exchanged by all-to-all: every rank's scores (and
    top-k candidates) are the torch teacher's, for a batch of rows and for one row alone (another shape)."""
    ranks, hf = ep_ranks
    rows = _omni_rows()
    for r in ranks:
        _assert_same(r["scores"], hf.score(rows))
        _assert_same(r["alone"], hf.score(rows[2:]))


@pytest.mark.slow
def test_a_tp2_ep2_teacher_holds_half_the_experts_on_each_rank_and_counts_the_whole_model(ep_ranks):
    ranks, hf = ep_ranks
    experts = hf.model.config.get_text_config().n_routed_experts
    for r in ranks:
        assert r["experts"] and set(r["experts"].values()) == {experts // 2}
    assert [r["parameters"] for r in ranks] == [sum(p.numel() for p in hf.model.parameters())] * 2


@pytest.mark.gpu
def test_on_two_gpus_a_tp2_ep2_teacher_scores_over_nccl_as_the_torch_teacher_within_bf16_error():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from megatron_helpers import spawn_ranks

    omni, rows = str(tiny_path("tiny-nemotron-omni")), _omni_rows()
    hf = TeacherModel(_omni_spec(omni, "cuda", "bfloat16"))
    want = [w["logp"].float().cpu() for w in hf.score(rows)]
    for r in spawn_ranks(_ep_rank, 2, omni, rows, "cuda", "bfloat16"):
        for g, w in zip(r["scores"], want):
            assert g["logp"].shape == w.shape and (g["logp"].float() - w).abs().max() < 0.05
