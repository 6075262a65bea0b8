"""Tiny in-memory HF decoders for the Megatron mapping and model tests (seeded; Qwen2 with non-zero q/k/v
biases and tied embeddings, Qwen3 with per-head q/k norms and its own head_dim, Llama with a separate head),
and the spawn of gloo ranks that the parallel tests share."""

import socket
import tempfile
from typing import Any, Callable, TypeVar

import torch

R = TypeVar("R")

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


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_result(rank: int, worker: Callable[..., Any], world: int, port: int, folder: str, args: tuple) -> None:
    torch.save(worker(rank, world, port, *args), f"{folder}/{rank}.pt")


def spawn_ranks(worker: Callable[..., R], world: int, *args: Any) -> list[R]:
    """Run `worker(rank, world, port, *args)` in `world` spawned processes and return what each rank returned,
    in rank order. A spawned process hands nothing back by itself, so each rank's result travels through a
    file of a temporary folder (torch.save / torch.load; the worker moves CUDA tensors to the CPU first). The
    worker joins its process group (gloo, or NCCL on GPUs) at tcp://127.0.0.1:port and leaves it. It is a
    module-level function (spawn pickles it by name), and anything costly that every rank needs (a tiny
    model's folder) is built before and passed in `args`: a spawned rank would otherwise build its own. A
    rank that raises fails the spawn with its traceback."""
    import torch.multiprocessing as mp

    for attempt in range(PORT_ATTEMPTS):
        with tempfile.TemporaryDirectory(prefix="gloo_ranks_") as folder:
            try:
                mp.spawn(_rank_result, args=(worker, world, free_port(), folder, args), nprocs=world, join=True)
            except mp.ProcessRaisedException as e:
                # the free port was taken by another process (a parallel test) before rank 0 listened on it
                if "EADDRINUSE" in str(e) and attempt + 1 < PORT_ATTEMPTS:
                    continue
                raise
            return [torch.load(f"{folder}/{r}.pt") for r in range(world)]
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3


def keep_router_grads(backend) -> list[torch.Tensor]:
    """A list that each optimizer step of `backend` fills, before it applies them, with its MoE routers'
    gradients in layer order (summed over the ranks that sum them, clipped): an HF backend's and a Megatron
    backend's compare router by router."""
    kept: list[torch.Tensor] = []
    routers = backend.router_terms.routers

    def keep(optimizer, args, kwargs):
        kept[:] = [r.weight.grad.detach().clone() for r in routers]

    backend.trainer.optimizer.register_step_pre_hook(keep)
    return kept
