"""GPU decoding on a preallocated KV cache: every decode step is one replay of a captured CUDA graph.

The HF backend's loop spends its time on the host: a transformers forward per token (hundreds of small
launches, a cache that grows by concatenation) and a `.tolist()` per token for the stop checks. Here the
prompt is prefilled exactly as there (one pass per distinct prompt, images through the hash-keyed feature
cache), its keys and values are copied into a static cache of shape [batch bucket, kv heads, length bucket,
head dim], and a decode step (sample from the last logits, record token and logprob, check stops, run the
text model on the sampled token) touches only fixed buffers. On CUDA that step is captured once per batch
bucket, length bucket, sampling mode and attention window, and replayed; the host only checks every
`sync_every` steps whether all rows have finished, one step group behind, so the GPU never waits for it.

The decode step reads the model's own parameters through small pure functions (Llama's RMSNorm, rotary
embedding, attention over the static cache, gated MLP), so it serves Llama-family text models with 1-D
rotary positions (LLaVA-style VLMs); `text_model` says why any other model is left to the HF loop.

Sampling: the logprob is `log_softmax(policy_logits / temperature)` of the drawn token, the trainer's
definition; vision tokens are at -inf. Draws use Gumbel-max with noise hashed from (row seed, step, token):
no generator state, so a graph replays it, and a row's samples depend on its seed alone, not on the batch
it shares (`SamplingParams.seed` s gives row b the seed (s, b)). Stop strings are found on the host after
the loop (the tokens after the match are cut), so they end a row's output but not its GPU work.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gymv.backends.generation.base import GenerationOutput, GenerationRequest, SamplingParams
from gymv.backends.generation.decode_attention import available as split_available
from gymv.backends.generation.decode_attention import split_attention
from gymv.backends.generation.hf import HFGenerationBackend, image_keys
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


class _State:
    """The fixed buffers of one (batch bucket, length bucket, mode), and its captured graphs."""

    def __init__(self, tm: TextModel, B: int, S: int, T: int, vocab: int, dtype, device):
        z = dict(device=device)
        self.B, self.S, self.T = B, S, T
        self.k = [torch.zeros(B, tm.kv_heads, S, tm.head_dim, dtype=dtype, **z) for _ in tm.layers]
        self.v = [torch.zeros(B, tm.kv_heads, S, tm.head_dim, dtype=dtype, **z) for _ in tm.layers]
        self.valid = torch.zeros(B, S, dtype=torch.bool, **z)
        self.logits = torch.zeros(B, vocab, dtype=torch.float32, **z)
        self.pos = torch.zeros(B, dtype=torch.long, **z)
        self.col = torch.zeros(1, dtype=torch.long, **z)
        self.step = torch.zeros(1, dtype=torch.long, **z)
        self.seeds = torch.zeros(B, dtype=torch.long, **z)
        self.done = torch.zeros(B, dtype=torch.bool, **z)
        self.tokens = torch.zeros(B, T, dtype=torch.long, **z)
        self.logprobs = torch.zeros(B, T, dtype=torch.float32, **z)
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
    reuses one compiled graph); if compiling fails the step runs uncompiled. `fuse_weights` stores each
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
                 attention: str = "auto"):
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

    def _set_functions(self, compiled: bool) -> None:
        fns = (_layer_pre, _layer_post, _lm_head, _draw)
        if compiled:
            fns = tuple(torch.compile(f, dynamic=False) for f in fns)
        self._pre, self._post, self._head, self._draw = fns

    # -- the decode step -----------------------------------------------------------------------------
    def _forward_token(self, st: _State, tok: torch.Tensor, window: int) -> torch.Tensor:
        """Logits [B, V] (float32) after feeding one token per row at column `st.col` (< `window`), positions
        `st.pos`; attention reads the cache's first `window` columns."""
        tm = self.tm
        x = tm.embed(tok[:, None])
        cos, sin = tm.rotary(x, st.pos[:, None])
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, head_dim]
        st.valid.index_fill_(1, st.col, True)
        split = self._split_attention
        if not split:
            bias = torch.zeros(st.valid.shape[0], 1, 1, window, dtype=x.dtype, device=x.device)
            bias = bias.masked_fill(~st.valid[:, None, None, :window], float("-inf"))
        for i, w in enumerate(self._fused):
            w = tuple(torch.cat(t) if isinstance(t, list) else t for t in w)
            q, k, v = self._pre(x, cos, sin, *w[:5], heads=tm.heads, kv_heads=tm.kv_heads, head_dim=tm.head_dim,
                                eps=self._eps)
            st.k[i].index_copy_(2, st.col, k)
            st.v[i].index_copy_(2, st.col, v)
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

    def _sample(self, st: _State, greedy: bool, nucleus: bool) -> torch.Tensor:
        """Draw from `st.logits`, record token and logprob at `st.step`, update the stop flags."""
        tok, lp, done = self._draw(st.logits, self._forbidden, st.temperature, st.top_p, st.seeds, st.step, st.vocab,
                                   st.done, st.stop_ids, pad=st.pad, greedy=greedy, nucleus=nucleus)
        st.tokens.index_copy_(1, st.step, tok[:, None])
        st.logprobs.index_copy_(1, st.step, lp[:, None])
        st.done.copy_(done)
        return tok

    def _decode_step(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        tok = self._sample(st, greedy, nucleus)
        st.logits.copy_(self._forward_token(st, tok, window))
        st.step += 1
        st.col += 1
        st.pos += 1

    def _capture(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        """Capture one decode step as a graph; buffers are saved and restored around the warm-up runs (which
        also compile), so capturing changes nothing a later step reads."""
        kept = (st.logits, st.pos, st.col, st.step, st.done, st.valid)
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
        key = (B, S, T, vocab, greedy, nucleus)
        if key in self._states:
            self._states.move_to_end(key)
            return self._states[key], False
        while len(self._states) >= self.max_states:
            self._states.popitem(last=False)
        dtype = next(self.model.parameters()).dtype
        st = _State(self.tm, B, S, T, vocab, dtype, self.device)
        self._states[key] = st
        return st, True

    def drop_graphs(self) -> None:
        """Free every static cache and captured graph (e.g. before training shares the GPU)."""
        self._states.clear()

    # -- generation ----------------------------------------------------------------------------------
    def _generate(self, requests: list[GenerationRequest], params: SamplingParams) -> list[GenerationOutput]:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        model, dev, tm = self.model, self.device, self.tm
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        keys = image_keys(requests)
        feats, grid = self._encode(requests, keys)
        slots: dict[tuple, int] = {}
        row_slot = [slots.setdefault((tuple(r.prompt_token_ids), tuple(ks)), len(slots))
                    for r, ks in zip(requests, keys)]
        firsts = [row_slot.index(u) for u in range(len(slots))]
        if len(firsts) < len(requests):
            starts = [0]
            for r in requests:
                starts.append(starts[-1] + len(r.images))
            feats = [feats[i] for b in firsts for i in range(starts[b], starts[b + 1])]
        prompts = [requests[b] for b in firsts]
        t_enc = time.perf_counter()

        B, U, L = len(requests), len(prompts), max(len(r.prompt_token_ids) for r in prompts)
        T = params.max_new_tokens
        input_ids = torch.full((U, L), pad, dtype=torch.long)
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

        greedy, nucleus = params.temperature == 0, params.top_p < 1.0
        self._fuse()
        Bb = _bucket(B, self.BATCH_BUCKETS)
        S = -(-(L + T) // self.LENGTH_BUCKET) * self.LENGTH_BUCKET
        st, _ = self._state(Bb, S, -(-T // self.LENGTH_BUCKET) * self.LENGTH_BUCKET, logits.shape[-1], greedy,
                                nucleus)
        if self._forbidden is None or self._forbidden.shape[0] != logits.shape[-1]:
            self._forbidden = forbidden_mask(logits.shape[-1], self.adapter.vision_token_ids, dev)
        # rows beyond B (bucket padding) copy row 0 and start finished
        rows = torch.tensor(row_slot + [row_slot[0]] * (Bb - B), device=dev)
        for i, (k, v) in enumerate(_cache_tensors(cache, len(tm.layers))):
            st.k[i][:, :, :L].copy_(k[rows])
            st.v[i][:, :, :L].copy_(v[rows])
        st.valid.zero_()
        st.valid[:, :L] = mask[rows].bool()
        st.logits.copy_(logits[rows].float())
        st.pos.copy_(mask.sum(-1)[rows])
        st.col.fill_(L)
        st.step.zero_()
        st.done.zero_()
        st.done[B:] = True
        st.tokens.fill_(pad)
        st.logprobs.zero_()
        st.pad = pad
        st.temperature.fill_(1.0 if greedy else float(params.temperature))
        st.top_p.fill_(float(params.top_p))
        stop = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        if len(stop) > st.stop_ids.numel():
            st.stop_ids = torch.full((len(stop),), -1, dtype=torch.long, device=dev)
            st.graphs.clear()
        st.stop_ids.fill_(-1)
        if stop:
            st.stop_ids[:len(stop)] = torch.tensor(stop, device=dev)
        st.seeds.copy_(self._row_seeds(Bb, params.seed))
        t_prefill = time.perf_counter()

        C = self.ATTENTION_CHUNK
        windows = [min(S, (L + j) // C * C + C) for j in range(T - 1)]  # step j writes column L + j
        use_graph = self.cuda_graphs and dev.type == "cuda" and T > 1  # one token: no decode step to replay
        if use_graph:
            for w in sorted(set(windows) - set(st.graphs)):
                self._capture_or_uncompile(st, greedy, nucleus, w)
        t_capture = time.perf_counter()
        flag = torch.zeros((), dtype=torch.bool, pin_memory=dev.type == "cuda")
        pending: torch.cuda.Event | None = None
        steps = 0
        for step in range(T - 1):
            if use_graph:
                st.graphs[windows[step]].replay()
            else:
                self._decode_step(st, greedy, nucleus, windows[step])
            steps += 1
            if (step + 1) % self.sync_every:
                continue
            if dev.type != "cuda":
                if bool(st.done.all()):
                    break
                continue
            if pending is not None:  # one group behind: the GPU keeps `sync_every` steps queued
                pending.synchronize()
                if bool(flag):
                    break
            flag.copy_(st.done.all(), non_blocking=True)
            pending = torch.cuda.Event()
            pending.record()
        self._sample(st, greedy, nucleus)
        tokens, logps = st.tokens[:B].tolist(), st.logprobs[:B].tolist()
        t_end = time.perf_counter()

        outs = [self._finish(tokens[b], logps[b], steps + 1, set(stop), params) for b in range(B)]
        self.last_timing = {"encode_s": t_enc - t0, "prefill_s": t_prefill - t_enc, "capture_s": t_capture - t_prefill,
                            "decode_s": t_end - t_capture, "total_s": t_end - t0,
                            "new_tokens": sum(len(o.token_ids) for o in outs), "decode_steps": steps + 1,
                            "batch": B, "batch_bucket": Bb, "cache_len": S, "prefill_rows": U}
        return outs

    def _capture_or_uncompile(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        try:
            self._capture(st, greedy, nucleus, window)
        except Exception as e:  # noqa: BLE001 - a compiler missing or failing must not stop generation
            if not self.compile:
                raise
            import warnings

            warnings.warn(f"torch.compile of the decode step failed ({type(e).__name__}: {e}); decoding uncompiled",
                          stacklevel=2)
            self.compile = False
            self._set_functions(False)
            st.graphs.clear()
            st.pool = None
            self._capture(st, greedy, nucleus, window)

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
    return tok, lp, done | torch.isin(tok, stop_ids)


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


def with_decode(backend, decode: str = "auto", *, seed: int = 0):
    """`backend` with the decode loop `decode` asks for (`generation.decode`): `static` turns an
    `HFGenerationBackend` into a `StaticDecodeBackend` on the same model (static cache, CUDA graphs on a
    GPU), `eager` keeps it, `auto` is static on CUDA where the model allows it and eager otherwise. Other
    engines decode their own way: they pass through `auto` and `eager`, and `static` is an error."""
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
                               max_cached_images=backend.max_cached_images, chat_template=backend.chat_template)


def hf_backend(policy, *, decode: str = "auto", seed: int = 0, **kwargs) -> HFGenerationBackend:
    """The in-process backend for `policy` with the decode loop `decode` asks for (see `with_decode`)."""
    return with_decode(HFGenerationBackend.from_policy(policy, seed=seed, **kwargs), decode, seed=seed)
