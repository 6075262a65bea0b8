"""Tiny in-memory HF decoders for the Megatron mapping and model tests (seeded; Qwen2 with non-zero q/k/v
biases and tied embeddings, Qwen3 with per-head q/k norms and its own head_dim, Llama with a separate head)."""

import torch

VOCAB = 96


def tiny_hf(family: str, *, seed: int = 0, vocab: int = VOCAB, dtype=torch.float32):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    cls_cfg, cls_model, tied = {"qwen2": (Qwen2Config, Qwen2ForCausalLM, True),
                                "qwen3": (Qwen3Config, Qwen3ForCausalLM, True),
                                "llama": (LlamaConfig, LlamaForCausalLM, False)}[family]
    extra = {"head_dim": 24} if family == "qwen3" else {}  # Qwen3's head_dim is its own, not hidden / heads
    cfg = cls_cfg(**extra, vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = cls_model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # HF starts these at 0 or 1: a misplaced one would hide
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.5)
    return model.to(dtype).eval()


def batch(seed: int = 1, vocab: int = VOCAB):
    """Two right-padded rows: the second ends in three pads."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    return ids, mask


def token_logprobs(logits, ids):
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def packed_token_logprobs(model, ids, mask):
    """The rows' token logprobs [B, T-1] from one packed forward (gymv.backends.packing), laid out as padded."""
    from gymv.backends import packed_attention
    from gymv.backends.packing import pack

    row = pack(ids, mask, [[] for _ in range(ids.shape[0])])
    logits = model(input_ids=row.input_ids[None], position_ids=row.positions[None],
                   **{packed_attention.KEYWORD: row.attention_args(ids.device)}).logits[0]
    real = mask.bool()
    full = logits.new_zeros((*mask.shape, logits.shape[-1])).index_put(real.nonzero(as_tuple=True), logits)
    return token_logprobs(full, ids)
