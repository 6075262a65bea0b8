"""gymv's HF <-> Megatron-core weight mapping: exact round trips, Megatron's grouped QKV layout, and tensor
parallel shards that reassemble into the full weights (pure tensor arithmetic: no megatron-core needed)."""

import pytest
import torch

from gymv.backends.training.megatron_weights import DecoderShape, fuse_qkv, hf_to_megatron, megatron_to_hf
from gymv.errors import GymvError
from megatron_helpers import tiny_hf


def _hf_state(model):
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_to_hf_round_trip_is_exact(family, tp):
    model = tiny_hf(family)
    shape = DecoderShape.of(model.config)
    hf = _hf_state(model)
    shards = [hf_to_megatron(hf, shape, tp_rank=r, tp_size=tp) for r in range(tp)]
    back = dict(megatron_to_hf(shards, shape))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qwen2_shape_has_qkv_biases_and_tied_head_llama_has_neither():
    q, l = DecoderShape.of(tiny_hf("qwen2").config), DecoderShape.of(tiny_hf("llama").config)
    assert (q.qkv_bias, q.tied) == (True, True)
    assert (l.qkv_bias, l.tied) == (False, False)
    assert "output_layer.weight" not in hf_to_megatron(_hf_state(tiny_hf("qwen2")), q)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in hf_to_megatron(_hf_state(tiny_hf("llama")), l)


def test_fused_qkv_interleaves_each_kv_group_as_its_queries_then_key_then_value():
    shape = DecoderShape(layers=1, hidden=1, heads=4, kv_heads=2, head_dim=1, ffn=1, vocab=1, tied=True, qkv_bias=False)
    q = torch.tensor([[0.], [1.], [2.], [3.]])  # query heads 0..3: heads 0,1 share kv group 0
    k = torch.tensor([[10.], [11.]])
    v = torch.tensor([[20.], [21.]])
    assert fuse_qkv(q, k, v, shape).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_tp_shards_split_whole_kv_groups_and_gate_up_per_rank():
    model = tiny_hf("qwen2")
    shape = DecoderShape.of(model.config)
    hf = _hf_state(model)
    full = hf_to_megatron(hf, shape)
    r1 = hf_to_megatron(hf, shape, tp_rank=1, tp_size=2)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(r1[qkv], full[qkv].chunk(2)[1])  # group 1 of 2, whole
    fc1 = r1["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    proj = r1["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"].chunk(2, dim=1)[1])


def test_a_tied_head_is_emitted_under_the_head_name_only_when_asked():
    model = tiny_hf("qwen2")
    shape = DecoderShape.of(model.config)
    shards = [hf_to_megatron(_hf_state(model), shape)]
    assert "lm_head.weight" not in dict(megatron_to_hf(shards, shape))
    out = dict(megatron_to_hf(shards, shape, include_tied_head=True))
    assert torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])


def test_a_tensor_parallel_size_that_splits_a_kv_group_is_refused_with_a_fix():
    shape = DecoderShape.of(tiny_hf("llama").config)  # 2 kv heads
    with pytest.raises(GymvError, match="tensor parallel size 4 does not divide the model's key/value heads"):
        hf_to_megatron(_hf_state(tiny_hf("llama")), shape, tp_rank=0, tp_size=4)


def test_a_decoder_family_without_a_mapping_is_refused_naming_the_other_backends():
    from transformers import GPT2Config

    with pytest.raises(GymvError, match="not 'gpt2'") as e:
        DecoderShape.of(GPT2Config())
    assert "training.backend: torch" in e.value.fix
