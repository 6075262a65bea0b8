"""GPU decoding on a preallocated KV cache: every decode step is one replay of a captured CUDA graph.

The HF backend's loop spends its time on the host: a transformers forward per token (hundreds of small
launches, a cache that grows by concatenation) and a `.tolist()` per token for the stop checks. Here the
prompt is prefilled exactly as there (one pass per distinct prompt, images through the hash-keyed feature
cache), its keys and values are copied into a static cache of shape [batch bucket, kv heads, length bucket,
head dim], and a decode step (sample from the last logits, record token and logprob, check stops, run the
text model on the sampled token) touches only fixed buffers. On CUDA that step is captured once per batch
bucket, length bucket, sampling mode and attention window, and replayed; the host only checks every
`sync_every` steps which rows have finished, one step group behind, so the GPU never waits for it.

Continuous batching: requests go through at most `max_batch` rows (slots). Every row keeps its own cache
column, position, token count and seed, so when a row finishes (stop token, stop string, token budget)
its slot takes the next waiting request, prefilled into that row alone; the others go on. A request's
samples depend on its seed and index (or its own seed), not on the slot it lands in or when. `serve` runs
the same loop over a feed that the caller fills while it decodes (the streamed rollout loop: an episode's
next turn takes a free slot as soon as it is ready), and moves the live rows into a smaller batch bucket
when the requests that may still come fit one; `generate` is a feed filled and closed up front.

The decode step reads the model's own parameters through small pure functions (Llama's RMSNorm, rotary
embedding, attention over the static cache, gated MLP), so it serves Llama-family text models with 1-D
rotary positions (LLaVA-style VLMs); `text_model` says why any other model is left to the HF loop.

Sampling: the logprob is `log_softmax(policy_logits / temperature)` of the drawn token, the trainer's
definition; vision tokens are at -inf. Draws use Gumbel-max with noise hashed from (row seed, step, token):
no generator state, so a graph replays it, and a row's samples depend on its seed alone, not on the batch
it shares (`SamplingParams.seed` s gives request i the seed (s, i)). Stop token ids are checked on the
device at every step. Stop strings are checked on the host at each `sync_every` check, on the tokens copied
there (no sync per token): a row that hit one is marked finished on the device, frees its slot and stops
holding up the loop; its output is cut exactly where the HF loop cuts it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gymv.backends.generation.base import GenerationOutput, GenerationRequest, OnOutput, RequestFeed, SamplingParams
from gymv.backends.generation.decode_attention import available as split_available
from gymv.backends.generation.decode_attention import split_attention
from gymv.backends.generation.hf import HFGenerationBackend, distinct_prompts, image_keys
from gymv.backends.hf_forward import forward_logits
from gymv.backends.sampling import forbidden_mask, policy_logits
from gymv.errors import GymvError

_M32 = 0xFFFFFFFF
ATTENTION_KERNELS = ("auto", "split", "sdpa")
SUPPORTED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")


@dataclass
class TextModel:
    """The parts of a decoder-only text model that one decode step uses."""

    embed: torch.nn.Module
    layers: Any
    norm: torch.nn.Module
    rotary: torch.nn.Module
    lm_head: torch.nn.Module
    kv_heads: int
    heads: int
    head_dim: int


def text_model(model) -> TextModel | str:
    """The text model's parts, or why the static decoder cannot run this model."""
    inner = getattr(model, "model", None)
    lm = next((m for m in (getattr(inner, "language_model", None), inner) if m is not None
               and all(hasattr(m, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))), None)
    if lm is None:
        return f"{type(model).__name__}: no decoder with embed_tokens/layers/norm/rotary_emb found"
    attn = lm.layers[0].self_attn
    if type(attn).__name__ not in SUPPORTED_ATTENTION:
        return f"attention {type(attn).__name__} is not one of {', '.join(SUPPORTED_ATTENTION)}"
    if any(getattr(layer.self_attn, "sliding_window", None) for layer in lm.layers):
        return "sliding-window attention"
    mlp = lm.layers[0].mlp
    gated = all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
    if not gated or mlp.gate_proj.bias is not None:
        return f"MLP {type(mlp).__name__} is not a bias-free gated MLP"
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        return "no bias-free LM head"
    cfg = attn.config
    if getattr(cfg, "rope_scaling", None) and (cfg.rope_scaling or {}).get("mrope_section"):
        return "multimodal (3-D) rotary positions"
    heads = cfg.num_attention_heads
    return TextModel(embed=lm.embed_tokens, layers=lm.layers, norm=lm.norm, rotary=lm.rotary_emb,
                     lm_head=head, kv_heads=cfg.num_key_value_heads, heads=heads,
                     head_dim=attn.head_dim)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, constants below 2**31 so int64 never overflows)."""
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x45D9F3B) & _M32
    return h ^ (h >> 16)


def gumbel_noise(seeds: torch.Tensor, step: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V], a pure function of (seed of row b, step, token id)."""
    key = _mix32((_mix32(seeds & _M32) + step * 0x3C6EF35) & _M32)
    h = _mix32((_mix32(key[:, None] ^ vocab[None, :]) + key[:, None]) & _M32)
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    step = buckets[-1]
    return -(-n // step) * step


def rows_that_fit(n: int, per_row: int, budget: float, buckets: tuple[int, ...]) -> int:
    """`n` if its batch bucket of rows of `per_row` bytes fits in `budget`, else the largest bucket below `n`
    that does (at least 1)."""
    if _bucket(n, buckets) * per_row <= budget:
        return n
    return max([b for b in buckets if b * per_row <= budget and b < n] or [1])


class _State:
    """The fixed buffers of one (batch bucket, length bucket, mode), and its captured graphs.

    Every counter is per row (slot): a slot refilled with a new request mid-loop starts its own count."""

    def __init__(self, tm: TextModel, B: int, S: int, T: int, vocab: int, dtype, device):
        z = dict(device=device)
        self.B, self.S, self.T = B, S, T
        self.k = [torch.zeros(B, tm.kv_heads, S, tm.head_dim, dtype=dtype, **z) for _ in tm.layers]
        self.v = [torch.zeros(B, tm.kv_heads, S, tm.head_dim, dtype=dtype, **z) for _ in tm.layers]
        self.valid = torch.zeros(B, S, dtype=torch.bool, **z)
        self.logits = torch.zeros(B, vocab, dtype=torch.float32, **z)
        self.pos = torch.zeros(B, dtype=torch.long, **z)  # rotary position of the row's next token
        self.col = torch.zeros(B, dtype=torch.long, **z)  # cache column the row's next token is written to
        self.step = torch.zeros(B, dtype=torch.long, **z)  # tokens the row has generated
        self.cap = torch.full((B,), T, dtype=torch.long, **z)  # the row finishes at this many tokens
        self.seeds = torch.zeros(B, dtype=torch.long, **z)
        self.done = torch.zeros(B, dtype=torch.bool, **z)
        self.tokens = torch.zeros(B, T + 1, dtype=torch.long, **z)  # column T: where finished rows write pads
        self.logprobs = torch.zeros(B, T + 1, dtype=torch.float32, **z)
        self.temperature = torch.ones((), dtype=torch.float32, **z)
        self.top_p = torch.ones((), dtype=torch.float32, **z)
        self.stop_ids = torch.full((8,), -1, dtype=torch.long, **z)
        self.vocab = torch.arange(vocab, dtype=torch.long, **z)
        self.pad = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # attention window -> the step that attends over it
        self.pool = None  # the graphs' memory pool: shared by this state's graphs only, freed with them


class StaticDecodeBackend(HFGenerationBackend):
    """Same interface and outputs as `HFGenerationBackend`; decoding on a static cache, graph-replayed on CUDA.

    `cuda_graphs` None means: on CUDA devices. `sync_every` is how many steps run between checks for
    "every row finished". Graph states are kept for the `max_states` most recent shapes. `compile` (None: on
    CUDA) runs the per-layer pieces of the step and the sampling through `torch.compile` (fused norms,
    rotary, residuals and noise; compiled once per batch bucket: the weights are arguments, so every layer
    reuses one compiled graph); if compiling fails the step runs uncompiled. On CUDA a call or session
    takes fewer rows than asked where their cache would fill more than `max_cache_fraction` of the free
    device memory (a session's cache is as long as its `max_seq_len`; a session that shrinks its batch keeps
    the smaller buckets' states too, under twice the first's size); None: no limit. `join_every` (None: at
    every check) is how many steps a session lets pass between two refills while other rows decode: each
    refill has a fixed cost (a sync, a prefill), so fewer, larger ones can be cheaper; rows that finish are
    still handed back at every check. `fuse_weights` stores each
    layer's q/k/v and gate/up weights in one tensor, the model's parameters becoming views of it, so one
    matrix product reads them (refits that copy into the parameters, as `update_weights` does, reach it).

    Each step attends over the cache columns up to the next multiple of `ATTENTION_CHUNK` past the newest
    token (one graph per such window), not over the whole preallocated length. `attention` picks the kernel:
    `split` (gymv.backends.generation.decode_attention, triton), `sdpa` (PyTorch's), `auto` (split on CUDA
    where triton is present, else sdpa).
    """

    BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    LENGTH_BUCKET = 64
    ATTENTION_CHUNK = 32

    def __init__(self, model, tokenizer, adapter, *, seed: int = 0, max_cached_images: int = 4096,
                 cuda_graphs: bool | None = None, sync_every: int = 16, max_states: int = 4,
                 compile: bool | None = None, fuse_weights: bool = True, chat_template: str | None = None,
                 attention: str = "auto", max_batch: int = 256, max_cache_fraction: float | None = 0.4,
                 join_every: int | None = None):
        super().__init__(model, tokenizer, adapter, seed=seed, max_cached_images=max_cached_images,
                         chat_template=chat_template)
        tm = text_model(model)
        if isinstance(tm, str):
            raise GymvError(f"static decoding does not support this model: {tm}", where="generation.decode",
                            fix="use generation.decode=eager (or auto, which falls back by itself)")
        self.tm = tm
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.sync_every = max(1, sync_every)
        self.max_states = max_states
        self._states: OrderedDict[tuple, _State] = OrderedDict()
        self._forbidden = None
        layer = tm.layers[0]
        self._eps = float(layer.input_layernorm.variance_epsilon)
        self._scale = float(layer.self_attn.scaling)
        self._act = layer.mlp.act_fn
        self.compile = (self.device.type == "cuda") if compile is None else compile
        self._set_functions(self.compile)
        self._fused: list[tuple] = []
        self._fused_at: list[int] = []
        self.fuse_weights = fuse_weights
        self.max_batch = max(1, max_batch)
        self.max_cache_fraction = max_cache_fraction
        self.join_every = join_every
        self._pad = 0
        self._times = {"encode_s": 0.0, "prefill_s": 0.0, "prefill_rows": 0}
        if attention not in ATTENTION_KERNELS:
            raise GymvError(f"decode attention must be one of {', '.join(ATTENTION_KERNELS)}, got {attention!r}",
                            where="StaticDecodeBackend(attention=...)", fix="use auto, split or sdpa")
        if attention == "split" and not split_available(self.device, tm.head_dim):
            raise GymvError("the split decode-attention kernel needs triton, a CUDA device (or TRITON_INTERPRET=1) "
                            f"and a power-of-two head dim (this model's: {tm.head_dim})",
                            where="StaticDecodeBackend(attention=...)", fix="use attention=auto or sdpa")
        self._split_attention = attention == "split" or (attention == "auto"
                                                         and split_available(self.device, tm.head_dim)
                                                         and self.device.type == "cuda")

    COMPILED_VARIANTS = len(BATCH_BUCKETS) * 3  # per function: a graph per batch bucket and sampling mode

    def _set_functions(self, compiled: bool) -> None:
        fns = (_layer_pre, _layer_post, _lm_head, _draw)
        if compiled:
            from gymv.backends.compile_limits import lift_recompile_limit

            lift_recompile_limit(self.COMPILED_VARIANTS)
            fns = tuple(torch.compile(f, dynamic=False) for f in fns)
        self._pre, self._post, self._head, self._draw = fns

    # -- the decode step -----------------------------------------------------------------------------
    def _forward_token(self, st: _State, tok: torch.Tensor, window: int) -> torch.Tensor:
        """Logits [B, V] (float32) after feeding one token per row at that row's column `st.col` (< `window`),
        positions `st.pos`; attention reads the cache's first `window` columns."""
        tm = self.tm
        x = tm.embed(tok[:, None])
        cos, sin = tm.rotary(x, st.pos[:, None])
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, head_dim]
        st.valid.scatter_(1, st.col[:, None], True)
        B, S, D = st.valid.shape[0], st.S, tm.head_dim
        # each (row, kv head)'s new key lands in row (b * heads + h) * S + col of the cache seen as [B*H*S, D]
        at = ((torch.arange(B * tm.kv_heads, device=tok.device).view(B, -1) * S) + st.col[:, None]).view(-1)
        split = self._split_attention
        if not split:
            bias = torch.zeros(st.valid.shape[0], 1, 1, window, dtype=x.dtype, device=x.device)
            bias = bias.masked_fill(~st.valid[:, None, None, :window], float("-inf"))
        for i, w in enumerate(self._fused):
            w = tuple(torch.cat(t) if isinstance(t, list) else t for t in w)
            q, k, v = self._pre(x, cos, sin, *w[:5], heads=tm.heads, kv_heads=tm.kv_heads, head_dim=tm.head_dim,
                                eps=self._eps)
            st.k[i].view(-1, D).index_copy_(0, at, k.reshape(-1, D))
            st.v[i].view(-1, D).index_copy_(0, at, v.reshape(-1, D))
            if split:
                o = split_attention(q.contiguous(), st.k[i], st.v[i], st.valid, window, self._scale)
            else:
                o = F.scaled_dot_product_attention(q, st.k[i][:, :, :window], st.v[i][:, :, :window],
                                                   attn_mask=bias, scale=self._scale)
            x = self._post(x, o, *w[5:], act=self._act, eps=self._eps)
        return self._head(x, tm.norm.weight, tm.lm_head.weight, eps=self._eps)

    def _fuse(self) -> None:
        """Per layer, the tensors the step reads: the model's own parameters, q/k/v and gate/up as views of
        one tensor each (`fuse_weights`) or as lists concatenated at each step. Redone, and the graphs that
        read the old memory dropped, when a parameter no longer lies where it did (it was replaced)."""
        if self._fused and self._where() == self._fused_at:
            return
        self.drop_graphs()
        self._fused = []
        join = _fuse_params if self.fuse_weights else list
        for layer in self.tm.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            self._fused.append((layer.input_layernorm.weight, join([p.weight for p in qkv]),
                                join([p.bias for p in qkv]) if a.q_proj.bias is not None else None,
                                getattr(getattr(a, "q_norm", None), "weight", None),
                                getattr(getattr(a, "k_norm", None), "weight", None),
                                a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight,
                                join([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight))
        self._fused_at = self._where()

    def _where(self) -> list[int]:
        """The address of every tensor of the text model a captured step reads."""
        mods = [self.tm.embed, self.tm.norm, self.tm.lm_head, self.tm.rotary, *self.tm.layers]
        return [t.data_ptr() for m in mods for t in (*m.parameters(), *m.buffers())]

    def _sample(self, st: _State, greedy: bool, nucleus: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw from `st.logits`, record token and logprob at each row's `st.step`, update the finished flags;
        (tokens, rows that were still generating)."""
        tok, lp, done = self._draw(st.logits, self._forbidden, st.temperature, st.top_p, st.seeds, st.step, st.vocab,
                                   st.done, st.stop_ids, pad=st.pad, greedy=greedy, nucleus=nucleus)
        st.tokens.scatter_(1, st.step[:, None], tok[:, None])
        st.logprobs.scatter_(1, st.step[:, None], lp[:, None])
        live = ~st.done
        st.done.copy_(done | (st.step + 1 >= st.cap))
        return tok, live

    def _decode_step(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        """Sample one token per row and feed it; a finished row stays where it is (it writes a pad to column T
        of its tokens, or past its last one, and rewrites one unused cache column)."""
        tok, live = self._sample(st, greedy, nucleus)
        st.logits.copy_(self._forward_token(st, tok, window))
        live = live.long()
        st.step += live
        st.col += live
        st.pos += live

    def _capture(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        """Capture one decode step as a graph; buffers are saved and restored around the warm-up runs (which
        also compile), so capturing changes nothing a later step reads."""
        kept = (st.logits, st.pos, st.col, st.step, st.done, st.valid, st.tokens, st.logprobs)
        saved = [t.clone() for t in kept]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one warm-up step, at the column the first real step rewrites
            self._decode_step(st, greedy, nucleus, window)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        if st.pool is None:
            st.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(g, pool=st.pool, capture_error_mode="thread_local"):
            self._decode_step(st, greedy, nucleus, window)
        for t, s in zip(kept, saved):
            t.copy_(s)
        st.graphs[window] = g

    def _state(self, B: int, S: int, T: int, vocab: int, greedy: bool, nucleus: bool) -> tuple[_State, bool]:
        """The buffers for B rows of up to S cache columns and T new tokens: a kept state of the same batch
        bucket and mode at least that long (its graphs reused: a GRPO run whose prompts vary in length
        does not capture again each step), else a new one."""
        fits = [key for key, st in self._states.items()
                if key[0] == B and key[3:] == (vocab, greedy, nucleus) and st.S >= S and st.T >= T]
        if fits:
            key = min(fits, key=lambda k: (k[1], k[2]))
            self._states.move_to_end(key)
            return self._states[key], False
        while len(self._states) >= self.max_states:
            self._states.popitem(last=False)
        dtype = next(self.model.parameters()).dtype
        st = _State(self.tm, B, S, T, vocab, dtype, self.device)
        self._states[(B, S, T, vocab, greedy, nucleus)] = st
        return st, True

    def drop_graphs(self) -> None:
        """Free every static cache and captured graph (e.g. before training shares the GPU)."""
        self._states.clear()

    # -- generation ----------------------------------------------------------------------------------
    def _prefill(self, requests: list[GenerationRequest]) -> tuple[list, torch.Tensor, torch.Tensor, list[int], int]:
        """One prefill pass over the distinct (prompt, images) of `requests`, left-padded to their longest:
        (per-layer (keys, values) [U, kv heads, L, head dim], last logits [U, V], mask [U, L], each request's
        prefill row, L)."""
        from transformers import DynamicCache

        model, dev = self.model, self.device
        t0 = time.perf_counter()
        keys = image_keys(requests)
        feats, grid = self._encode(requests, keys)
        self._times["encode_s"] += time.perf_counter() - t0
        row_slot, firsts, image_idx = distinct_prompts(requests, keys)
        if image_idx is not None:
            feats = [feats[i] for i in image_idx]
        prompts = [requests[b] for b in firsts]
        U, L = len(prompts), max(len(r.prompt_token_ids) for r in prompts)
        self._times["prefill_rows"] += U
        input_ids = torch.full((U, L), self._pad, dtype=torch.long)
        mask = torch.zeros((U, L), dtype=torch.long)
        for b, r in enumerate(prompts):
            n = len(r.prompt_token_ids)
            input_ids[b, L - n:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[b, L - n:] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = self.adapter.position_ids(model, input_ids, mask, grid)
        cache = DynamicCache(config=model.config)
        logits = forward_logits(model, input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                image_token_id=self.adapter.image_token_id, features=feats, cache=cache,
                                logits_to_keep=1)[:, -1]
        return _cache_tensors(cache, len(self.tm.layers)), logits, mask, row_slot, L

    def _fill(self, st: _State, slots: list[int], requests: list[GenerationRequest], seeds: torch.Tensor,
              caps: list[int]) -> int:
        """Prefill `requests` into rows `slots` of the static cache (columns 0..L-1, L their longest prompt):
        each row starts its own count, seed and token cap. Returns L."""
        dev, t0, enc = self.device, time.perf_counter(), self._times["encode_s"]
        kv, logits, mask, row_slot, L = self._prefill(requests)
        rows = torch.tensor(row_slot, device=dev)
        at = torch.tensor(slots, device=dev)
        for i, (k, v) in enumerate(kv):
            st.k[i][:, :, :L].index_copy_(0, at, k[rows].to(st.k[i].dtype))
            st.v[i][:, :, :L].index_copy_(0, at, v[rows].to(st.v[i].dtype))
        valid = torch.zeros(len(slots), st.S, dtype=torch.bool, device=dev)
        valid[:, :L] = mask[rows].bool()
        st.valid.index_copy_(0, at, valid)
        st.logits.index_copy_(0, at, logits[rows].float())
        st.pos.index_copy_(0, at, mask.sum(-1)[rows])
        st.col.index_fill_(0, at, L)
        st.step.index_fill_(0, at, 0)
        st.done.index_fill_(0, at, False)
        st.cap.index_copy_(0, at, torch.tensor(caps, dtype=torch.long, device=dev))
        st.tokens.index_fill_(0, at, st.pad)
        st.logprobs.index_fill_(0, at, 0.0)
        st.seeds.index_copy_(0, at, seeds)
        self._times["prefill_s"] += time.perf_counter() - t0 - (self._times["encode_s"] - enc)
        return L

    def _generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        """Requests go through `max_batch` slots: the first ones are prefilled together; when a row finishes
        (a stop token, a stop string, its token budget) its slot takes the next waiting request, prefilled on
        its own columns. A request's samples depend on its seed and index alone, not on its slot."""
        outs: dict[int, GenerationOutput] = {}
        longest = max(len(r.prompt_token_ids) for r in requests)
        self._serve(RequestFeed(enumerate(requests), closed=True), params, outs.__setitem__,
                    max_len=longest + params.max_new_tokens, slots=len(requests))
        return [outs[i] for i in range(len(requests))]

    serves_continuously = True

    def serve(self, feed: RequestFeed, params: SamplingParams, on_output: OnOutput, *,
              max_seq_len: int | None = None, slots: int | None = None) -> None:
        """Continuous batching over a feed: a request that becomes ready while others decode takes a free slot
        at the next check (every `sync_every` steps), prefilled on its own columns. The cache is as long as
        `max_seq_len` (bucketed; else the first requests' longest prompt plus `max_new_tokens`): a request
        that could outgrow it is refused. `slots` (else `max_batch`, and never more) sizes the batch."""
        params.validate()
        with torch.no_grad():
            self._serve(feed, params, on_output, max_len=max_seq_len, slots=slots)

    def _cache_len(self, max_len: int) -> int:
        return -(-(max_len + 1) // self.LENGTH_BUCKET) * self.LENGTH_BUCKET

    def _rows_that_fit(self, n: int, S: int) -> int:
        """`n`, or fewer rows (a smaller batch bucket) where `n` rows of S columns would take more than
        `max_cache_fraction` of the device's free memory; the requests left over wait for a free slot."""
        if self.device.type != "cuda" or not self.max_cache_fraction:
            return n
        free, _ = torch.cuda.mem_get_info(self.device)
        tm, size = self.tm, next(self.model.parameters()).element_size()
        per_row = 2 * len(tm.layers) * tm.kv_heads * tm.head_dim * S * size
        return rows_that_fit(n, per_row, free * self.max_cache_fraction, self.BATCH_BUCKETS)

    def _admit(self, key, r: GenerationRequest, S: int, T: int) -> int:
        """Check one request as `generate` does and against the cache length; its token cap."""
        where = r.where or f"request {key}"
        if not r.prompt_token_ids:
            raise GymvError("empty prompt", where=where, fix="render at least one message before generating")
        self.adapter.check(r.prompt_token_ids, r.images, where=where)
        cap = T if r.max_new_tokens is None else min(T, r.max_new_tokens)
        if cap < 1:
            raise GymvError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}", where=where,
                            fix="do not send a request with no room to generate")
        if len(r.prompt_token_ids) + cap + 1 > S:
            raise GymvError(f"the request needs {len(r.prompt_token_ids)} prompt + {cap} new tokens, over this "
                            f"session's cache of {S} columns", where=where,
                            fix="pass serve(max_seq_len=...) at least the longest sequence the caller builds")
        return cap

    def _seeds(self, requests: list[GenerationRequest], start: int, seed: int | None) -> torch.Tensor:
        """Row seeds: a request's own `seed`, else (`seed`, its arrival index), else random."""
        base = self._row_seeds(start + len(requests), seed)[start:]
        own = [(i, r.seed) for i, r in enumerate(requests) if r.seed is not None]
        if own:
            idx = torch.tensor([i for i, _ in own], device=self.device)
            vals = torch.tensor([(s * 0x9E3779B1 + 0x2545F491) & _M32 for _, s in own], device=self.device)
            base = base.index_copy(0, idx, _mix32(_mix32(vals) ^ 0x5BD1E995))
        return base

    def _serve(self, feed: RequestFeed, params: SamplingParams, on_output: OnOutput, *, max_len: int | None,
               slots: int | None) -> None:
        t0 = time.perf_counter()
        dev = self.device
        self._times = {"encode_s": 0.0, "prefill_s": 0.0, "prefill_rows": 0}
        self._pad = pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        T = params.max_new_tokens
        usable = max(1, min(self.max_batch, slots or self.max_batch))
        if max_len is not None:
            usable = self._rows_that_fit(usable, self._cache_len(max_len))
        first = feed.take(usable, block=True)
        if not first or feed.cancelled:
            return
        Bb = _bucket(usable, self.BATCH_BUCKETS)
        if max_len is None:
            max_len = max(len(r.prompt_token_ids) for _, r in first) + T
        S = self._cache_len(max_len)
        greedy, nucleus = params.temperature == 0, params.top_p < 1.0
        self._fuse()
        vocab = self.tm.lm_head.weight.shape[0]
        st, _ = self._state(Bb, S, -(-T // self.LENGTH_BUCKET) * self.LENGTH_BUCKET, vocab, greedy, nucleus)
        if self._forbidden is None or self._forbidden.shape[0] != vocab:
            self._forbidden = forbidden_mask(vocab, self.adapter.vision_token_ids, dev)
        stop = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        stop_set = set(stop)

        def setup(state: _State) -> None:
            state.pad = pad
            state.temperature.fill_(1.0 if greedy else float(params.temperature))
            state.top_p.fill_(float(params.top_p))
            if len(stop) > state.stop_ids.numel():
                state.stop_ids = torch.full((len(stop),), -1, dtype=torch.long, device=dev)
                state.graphs.clear()
            state.stop_ids.fill_(-1)
            if stop:
                state.stop_ids[:len(stop)] = torch.tensor(stop, device=dev)

        setup(st)
        keys: dict[int, Any] = {}  # arrival index -> the caller's key
        caps: list[int] = []  # arrival index -> token cap

        def admit(batch: list) -> tuple[list[int], list[GenerationRequest], torch.Tensor]:
            start = len(caps)
            reqs = [r for _, r in batch]
            for i, (key, r) in enumerate(batch):
                caps.append(self._admit(key, r, st.S, T))
                keys[start + i] = key
            return list(range(start, len(caps))), reqs, self._seeds(reqs, start, params.seed)

        ids0, reqs0, seeds0 = admit(first)
        n0 = len(ids0)
        # rows beyond the first requests (bucket padding, free slots) copy request 0 and start finished
        rows0 = list(range(n0)) + [0] * (Bb - n0)
        L = self._fill(st, list(range(Bb)), [reqs0[i] for i in rows0], seeds0[torch.tensor(rows0, device=dev)],
                       [caps[i] for i in rows0])
        if Bb > n0:
            st.done[n0:] = True
        t_prefill = time.perf_counter()

        stop_strings = tuple(x for x in params.stop_strings if x)
        windows_of = {s: len(s.encode("utf-8")) + 1 for s in stop_strings}
        slot_req: list[int | None] = ids0 + [None] * (Bb - n0)
        cap_of = [caps[0]] * Bb
        for s_, r in enumerate(ids0):
            cap_of[s_] = caps[r]
        filled_at = [0] * Bb  # the step count when the slot took its request
        start_col = [L] * Bb
        checked = [0] * Bb  # tokens of the slot's request already searched for stop strings
        cut: dict[int, int] = {}  # request -> length where a stop string ended it (found mid-loop)
        use_graph = self.cuda_graphs and dev.type == "cuda"
        C = self.ATTENTION_CHUNK
        capture_s = refill_s = idle_s = handoff_s = 0.0
        steps = refills = refill_calls = joined = repacks = new_tokens = row_steps = 0  # joined: while others decoded
        last_join = 0
        pinned = dev.type == "cuda"

        def host_buffers(B: int, state: _State) -> tuple:
            """Pinned host copies of the finished flags (and, for stop strings, tokens and counts)."""
            return (torch.zeros(B, dtype=torch.bool, pin_memory=pinned),
                    torch.zeros(B, state.T + 1, dtype=torch.long, pin_memory=pinned) if stop_strings else None,
                    torch.zeros(B, dtype=torch.long, pin_memory=pinned) if stop_strings else None)

        host_done, host_tokens, host_step = host_buffers(Bb, st)
        pending: torch.cuda.Event | None = None
        live: list[int] = []
        parked: list[int] = []  # finished rows read out at the end (nothing more can come: no sync needed)
        hi_base = hi_cap = 0

        def refresh() -> None:
            """Per-step bounds over the slots still serving a request: the newest column any may write, and
            the step by which all have hit their token budget."""
            nonlocal live, hi_base, hi_cap
            live = [s_ for s_ in range(Bb) if slot_req[s_] is not None and s_ not in parked]
            if live:
                hi_base = max(start_col[s_] - filled_at[s_] for s_ in live)
                hi_cap = max(start_col[s_] + cap_of[s_] for s_ in live)

        def harvest(slot_ids: list[int]) -> None:
            """Read the rows out and hand each output back (a sync with the device)."""
            nonlocal handoff_s, new_tokens
            th = time.perf_counter()
            idx = torch.tensor(slot_ids, device=dev)
            toks, lps, lens = st.tokens[idx].tolist(), st.logprobs[idx].tolist(), st.step[idx].tolist()
            for j, s_ in enumerate(slot_ids):
                r = slot_req[s_]
                n = min(lens[j], cut.get(r, lens[j]))
                out = self._finish(toks[j][:n], lps[j][:n], n, stop_set, params)
                new_tokens += len(out.token_ids)
                slot_req[s_] = None
                on_output(keys.pop(r), out)
            handoff_s += time.perf_counter() - th

        def snapshot() -> None:
            """Queue a copy of the finished flags (and tokens, for stop strings) for the next check to read."""
            nonlocal pending
            host_done.copy_(st.done, non_blocking=True)
            if stop_strings:
                host_tokens.copy_(st.tokens, non_blocking=True)
                host_step.copy_(st.step, non_blocking=True)
            pending = torch.cuda.Event()
            pending.record()

        def refill(batch: list) -> None:
            nonlocal refills, refill_calls, refill_s, joined, last_join
            tr = time.perf_counter()
            free = [s_ for s_ in range(usable) if slot_req[s_] is None]
            ids, reqs, seeds = admit(batch)
            take = free[:len(ids)]
            Lf = self._fill(st, take, reqs, seeds, [caps[r] for r in ids])
            for s_, r in zip(take, ids):
                slot_req[s_], filled_at[s_], start_col[s_], checked[s_], cap_of[s_] = r, steps, Lf, 0, caps[r]
            refills += len(take)
            refill_calls += 1
            last_join = steps
            if any(slot_req[s_] is not None for s_ in range(Bb) if s_ not in take):
                joined += len(take)
            if dev.type == "cuda":  # flags copied before the refill describe the slots' old requests
                snapshot()
            refill_s += time.perf_counter() - tr

        def repack() -> None:
            """Move the rows still serving a request into the smallest batch bucket that holds every request
            that may still come (`feed.open_keys`), when that is smaller than the current one: a session's
            tail, its few longest episodes, then decodes on fewer rows."""
            nonlocal st, Bb, usable, slot_req, filled_at, start_col, checked, cap_of, repacks, refill_s
            nonlocal host_done, host_tokens, host_step
            open_keys = feed.open_keys
            src = [s_ for s_ in range(Bb) if slot_req[s_] is not None]
            if open_keys is None or parked or _bucket(max(1, open_keys, len(src)), self.BATCH_BUCKETS) >= Bb:
                return
            tr = time.perf_counter()
            B2 = _bucket(max(1, open_keys, len(src)), self.BATCH_BUCKETS)
            st2, _ = self._state(B2, st.S, st.T, vocab, greedy, nucleus)
            setup(st2)
            st2.done.fill_(True)
            st2.valid.zero_()
            st2.tokens.fill_(pad)
            n = len(src)
            if n:
                idx = torch.tensor(src, device=dev)
                for i in range(len(st.k)):
                    st2.k[i][:n, :, :st.S] = st.k[i][idx]
                    st2.v[i][:n, :, :st.S] = st.v[i][idx]
                st2.valid[:n, :st.S] = st.valid[idx]
                for name in ("logits", "pos", "col", "step", "cap", "seeds", "done"):
                    getattr(st2, name)[:n] = getattr(st, name)[idx]
                st2.tokens[:n, :st.T] = st.tokens[idx, :st.T]
                st2.logprobs[:n, :st.T] = st.logprobs[idx, :st.T]
            moved = src + [None] * (B2 - n)
            slot_req = [None if s_ is None else slot_req[s_] for s_ in moved]
            filled_at, start_col, checked, cap_of = ([0 if s_ is None else xs[s_] for s_ in moved]
                                                     for xs in (filled_at, start_col, checked, cap_of))
            st, Bb, usable = st2, B2, min(usable, B2)
            host_done, host_tokens, host_step = host_buffers(B2, st2)
            if dev.type == "cuda":
                snapshot()
            repacks += 1
            refill_s += time.perf_counter() - tr

        refresh()
        while True:
            if feed.cancelled:
                break
            if not live:
                repack()
                ti = time.perf_counter()
                batch = feed.take(usable, block=True)  # nothing to decode: wait for the caller
                idle_s += time.perf_counter() - ti
                if not batch or feed.cancelled:
                    break
                refill(batch)
                refresh()
                continue
            window = min(st.S, min(hi_base + steps, hi_cap) // C * C + C)
            if all(steps - filled_at[s_] == cap_of[s_] - 1 for s_ in live) and feed.exhausted():
                _, going = self._sample(st, greedy, nucleus)  # every row's last token: nothing left to feed
                st.step += going.long()
                harvest(live + parked)
                parked = []
                steps += 1
                row_steps += Bb
                break
            if use_graph:
                if window not in st.graphs:
                    tc = time.perf_counter()
                    self._capture_or_uncompile(st, greedy, nucleus, window)
                    capture_s += time.perf_counter() - tc
                st.graphs[window].replay()
            else:
                self._decode_step(st, greedy, nucleus, window)
            steps += 1
            row_steps += Bb
            spent = all(steps - filled_at[s_] >= cap_of[s_] for s_ in live)  # every live row hit its budget
            if steps % self.sync_every and not spent:
                continue
            # a check: which rows finished (on CUDA as of the previous check: the GPU keeps a group queued)
            if dev.type == "cuda" and not spent:
                seen = pending is not None
                if seen:
                    pending.synchronize()
                    done_now = host_done.clone()
                    toks_now = host_tokens.clone() if stop_strings else None
                    step_now = host_step.clone() if stop_strings else None
                snapshot()
                if not seen:
                    continue
            else:
                done_now = st.done.cpu()
                toks_now = st.tokens.cpu() if stop_strings else None
                step_now = st.step.cpu() if stop_strings else None
            if stop_strings:
                ended = []
                for s_ in live:
                    r = slot_req[s_]
                    if bool(done_now[s_]) or r in cut:
                        continue
                    row, n = toks_now[s_].tolist(), int(step_now[s_])
                    for j in range(checked[s_], n):
                        if self._stop_string(row[:j + 1], stop_strings, windows_of) is not None:
                            cut[r] = j + 1
                            ended.append(s_)
                            break
                    checked[s_] = n
                if ended:
                    st.done.index_fill_(0, torch.tensor(ended, device=dev), True)
                    done_now = done_now.clone()
                    done_now[ended] = True
            finished = [s_ for s_ in live if bool(done_now[s_]) or steps - filled_at[s_] >= cap_of[s_]]
            if finished:
                if feed.exhausted():
                    parked += finished
                else:
                    harvest(finished)
            due = self.join_every is None or steps - last_join >= self.join_every
            if due and not feed.exhausted() and any(slot_req[s_] is None for s_ in range(usable)):
                batch = feed.take(sum(slot_req[s_] is None for s_ in range(usable)), block=False)
                if batch:
                    refill(batch)
            repack()
            refresh()
        if parked and not feed.cancelled:
            harvest(parked)
        t_end = time.perf_counter()
        self.last_timing = {**self._times, "capture_s": capture_s,
                            "decode_s": t_end - t_prefill - capture_s - refill_s - idle_s - handoff_s,
                            "refill_s": refill_s, "idle_s": idle_s, "handoff_s": handoff_s, "total_s": t_end - t0,
                            "new_tokens": new_tokens, "decode_steps": steps, "batch": len(caps),
                            "batch_bucket": Bb, "slots": usable, "cache_len": st.S, "refills": refills,
                            "refill_calls": refill_calls, "joined": joined, "repacks": repacks,
                            "row_steps": row_steps}

    def _capture_or_uncompile(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        """Capture; if that fails, capture again with the split attention kernel off (SDPA), then uncompiled."""
        try:
            self._capture(st, greedy, nucleus, window)
        except Exception as e:  # noqa: BLE001 - a kernel or compiler failing must not stop generation
            if not (self._split_attention or self.compile):
                raise
            import warnings

            if self._split_attention:
                what = "the split decode-attention kernel failed; decoding with SDPA"
                self._split_attention = False
            else:
                what = "torch.compile of the decode step failed; decoding uncompiled"
                self.compile = False
                self._set_functions(False)
            warnings.warn(f"{what} ({type(e).__name__}: {e})", stacklevel=2)
            st.graphs.clear()
            st.pool = None
            self._capture_or_uncompile(st, greedy, nucleus, window)

    def _row_seeds(self, n: int, seed: int | None) -> torch.Tensor:
        if seed is None:
            return torch.randint(0, 2**31 - 1, (n,), generator=self._generator, device=self.device)
        return _mix32(torch.arange(n, dtype=torch.long, device=self.device) + (int(seed) & _M32) * 0x10001 & _M32)

    def _finish(self, row: list[int], lps: list[float], n: int, stop_ids: set[int],
                params: SamplingParams) -> GenerationOutput:
        toks, lps = row[:n], lps[:n]
        end = next((j for j, t in enumerate(toks) if t in stop_ids), None)
        finish: tuple[str, Any] = ("length", None)
        if end is not None:
            toks, lps, finish = toks[:end + 1], lps[:end + 1], ("stop", toks[end])
        stop_strings = tuple(s for s in params.stop_strings if s)
        if stop_strings:
            windows = {s: len(s.encode("utf-8")) + 1 for s in stop_strings}
            for j in range(len(toks)):
                hit = self._stop_string(toks[:j + 1], stop_strings, windows)
                if hit is not None:
                    toks, lps, finish = toks[:j + 1], lps[:j + 1], ("stop", hit)
                    break
        return GenerationOutput(token_ids=toks, logprobs=lps,
                                text=self.tokenizer.decode(toks, skip_special_tokens=True),
                                finish_reason=finish[0], stop_reason=finish[1])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _fuse_params(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor holding `params` end to end along dim 0; each parameter becomes a view of its rows. Where
    they already are (fused before, by this or another backend on the same model), that tensor is reused."""
    first = params[0].data
    rows = sum(p.shape[0] for p in params)
    if all(p.data.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           for p in params):
        offsets = [first.storage_offset()]
        for p in params[:-1]:
            offsets.append(offsets[-1] + p.numel())
        if all(p.storage_offset() == o for p, o in zip(params, offsets)):
            return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                           (rows, *first.shape[1:]), first.stride())
    fused = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[start:start + n]
        start += n
    return fused


def _layer_pre(x, cos, sin, ln, wqkv, bqkv, qn, kn, *, heads: int, kv_heads: int, head_dim: int, eps: float):
    """Norm, projections and rotary of one token per row: q [B, kv heads, heads per kv head, d], k and v
    [B, kv heads, 1, d]; the query heads that share a kv head attend as one short sequence against it."""
    B = x.shape[0]
    h = _rms(x, ln, eps)
    qkv = F.linear(h, wqkv, bqkv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(B, 1, heads, head_dim)
    k = k.view(B, 1, kv_heads, head_dim)
    v = v.view(B, 1, kv_heads, head_dim).transpose(1, 2)
    if qn is not None:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q.reshape(B, kv_heads, heads // kv_heads, head_dim), k, v


def _layer_post(x, o, wo, bo, ln, wgu, wd, *, act, eps: float):
    """Output projection, residual, norm, gated MLP, residual."""
    B = x.shape[0]
    x = x + F.linear(o.reshape(B, 1, -1), wo, bo)
    gate, up = F.linear(_rms(x, ln, eps), wgu).chunk(2, dim=-1)
    return x + F.linear(act(gate) * up, wd)


def _draw(logits, forbidden, temperature, top_p, seeds, step, vocab, done, stop_ids, *, pad: int, greedy: bool,
          nucleus: bool):
    """(token, its logprob under the policy distribution, finished flags) for one step of every row; a row
    already finished draws `pad`."""
    z = policy_logits(logits, 1.0, forbidden) / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    if greedy:
        tok = z.argmax(-1)
    else:
        drawn = z
        if nucleus:
            p = torch.softmax(z, dim=-1)
            sp, order = p.sort(dim=-1, descending=True)
            drop = (sp.cumsum(-1) - sp) >= top_p
            drawn = z.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
        tok = (drawn + gumbel_noise(seeds, step, vocab)).argmax(-1)
    lp = (z.gather(-1, tok[:, None]) - lse).squeeze(-1)
    tok = torch.where(done, torch.full_like(tok, pad), tok)
    return tok, lp, done | (tok.unsqueeze(-1) == stop_ids).any(-1)  # torch.isin cannot be captured in a CUDA graph


def _lm_head(x, norm, head, *, eps: float):
    return F.linear(_rms(x, norm, eps), head)[:, 0].float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cache_tensors(cache, n_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [B, kv heads, L, head dim] of every layer of a transformers DynamicCache (5.x layouts)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers[:n_layers]]
    return list(zip(cache.key_cache[:n_layers], cache.value_cache[:n_layers]))


DECODE_MODES = ("auto", "eager", "static")


def with_decode(backend, decode: str = "auto", *, seed: int = 0, max_batch: int = 256):
    """`backend` with the decode loop `decode` asks for (`generation.decode`): `static` turns an
    `HFGenerationBackend` into a `StaticDecodeBackend` on the same model (static cache, CUDA graphs on a
    GPU), `eager` keeps it, `auto` is static on CUDA where the model allows it and eager otherwise. Other
    engines decode their own way: they pass through `auto` and `eager`, and `static` is an error.
    `max_batch` (`generation.max_batch`) caps the static decoder's slots, and so its KV cache."""
    if decode not in DECODE_MODES:
        raise GymvError(f"generation.decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}",
                        fix="use auto (static on CUDA), static or eager")
    if isinstance(backend, StaticDecodeBackend) or decode == "eager":
        return backend
    if type(backend) is not HFGenerationBackend:
        if decode == "static":
            raise GymvError(f"generation.decode=static needs the hf backend, not {type(backend).__name__}",
                            where="generation.decode", fix="use generation.decode=auto with this backend")
        return backend
    if decode == "auto" and (backend.device.type != "cuda" or isinstance(text_model(backend.model), str)):
        return backend
    return StaticDecodeBackend(backend.model, backend.tokenizer, backend.adapter, seed=seed,
                               max_cached_images=backend.max_cached_images, chat_template=backend.chat_template,
                               max_batch=max_batch)


def hf_backend(policy, *, decode: str = "auto", seed: int = 0, **kwargs) -> HFGenerationBackend:
    """The in-process backend for `policy` with the decode loop `decode` asks for (see `with_decode`)."""
    return with_decode(HFGenerationBackend.from_policy(policy, seed=seed, **kwargs), decode, seed=seed)
