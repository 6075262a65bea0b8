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
rotary positions (LLaVA-style VLMs), and Nemotron-H hybrids (Mamba-2, attention, mixture-of-experts layers;
their per-row Mamba states live beside the KV cache, see `static_hybrid`); `text_model` says why any other
model is left to the HF loop.

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
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from gymv.backends import mamba_kernels
from gymv.backends.compile_limits import lift_recompile_limit
from gymv.backends.generation import static_hybrid as hybrid
from gymv.backends.generation.base import GenerationOutput, GenerationRequest, OnOutput, RequestFeed, SamplingParams
from gymv.backends.generation.decode_attention import available as split_available
from gymv.backends.generation.decode_attention import split_attention
from gymv.backends.generation.hf import HFGenerationBackend, _forward_kwargs, distinct_prompts, image_keys, left_pad
from gymv.backends.hf_forward import forward_logits, output_head
from gymv.backends.sampling import forbidden_mask, policy_logits
from gymv.errors import GymvError
from gymv.sections import GenerationSection, default

_M32 = 0xFFFFFFFF
ATTENTION_KERNELS = ("auto", "split", "sdpa")
SUPPORTED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")


@dataclass
class TextModel:
    """The parts of a decoder-only text model that one decode step uses.

    `kinds` names each layer's step: `decoder` (a Llama-family layer: attention then gated MLP) or, for a
    Nemotron-H hybrid, `attention`, `mamba`, `moe` or `mlp` (one mixer each, see `static_hybrid`)."""

    embed: torch.nn.Module
    layers: Any
    norm: torch.nn.Module
    rotary: torch.nn.Module | None
    lm_head: torch.nn.Module
    kv_heads: int
    heads: int
    head_dim: int
    eps: float
    scale: float
    kinds: tuple[str, ...]
    mamba: hybrid.MambaShape | None = None
    moe: hybrid.MoeShape | None = None

    @property
    def is_hybrid(self) -> bool:
        return self.rotary is None

    def has_kv(self, i: int) -> bool:
        return self.kinds[i] in ("decoder", "attention")

    def row_bytes(self, S: int, size: int) -> int:
        """Bytes of one row's cache of S columns: keys and values of the attention layers, both Mamba states."""
        kv = sum(map(self.has_kv, range(len(self.kinds)))) * 2 * self.kv_heads * self.head_dim * S * size
        m = self.mamba
        states = 0 if m is None else self.kinds.count("mamba") * (m.conv_dim * m.kernel * size
                                                                  + m.heads * m.head_dim * m.state * 4)
        return kv + states


def text_model(model) -> TextModel | str:
    """The text model's parts, or why the static decoder cannot run this model."""
    lm = hybrid.decoder(model)
    if lm is not None:
        return _hybrid_text_model(model, lm)
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
    return TextModel(embed=lm.embed_tokens, layers=lm.layers, norm=lm.norm, rotary=lm.rotary_emb,
                     lm_head=head, kv_heads=cfg.num_key_value_heads, heads=cfg.num_attention_heads,
                     head_dim=attn.head_dim, eps=float(lm.layers[0].input_layernorm.variance_epsilon),
                     scale=float(attn.scaling), kinds=("decoder",) * len(lm.layers))


def _hybrid_text_model(model, lm) -> TextModel | str:
    why = hybrid.unsupported(lm)
    if why:
        return why
    head = output_head(model)
    if head is None or getattr(head, "bias", None) is not None:
        return "no bias-free LM head"
    cfg = lm.config
    kinds, mamba, moe = hybrid.shapes(lm)
    attn = next((layer.mixer for layer, kind in zip(lm.layers, kinds) if kind == "attention"), None)
    return TextModel(embed=lm.embeddings, layers=lm.layers, norm=lm.norm_f, rotary=None, lm_head=head,
                     kv_heads=cfg.num_key_value_heads, heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                     eps=float(lm.norm_f.variance_epsilon), scale=float(attn.scaling) if attn else 1.0, kinds=kinds,
                     mamba=mamba if "mamba" in kinds else None, moe=moe if "moe" in kinds else None)


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
        kv = [tm.has_kv(i) for i in range(len(tm.kinds))]
        self.k = [torch.zeros(B, tm.kv_heads, S, tm.head_dim, dtype=dtype, **z) if a else None for a in kv]
        self.v = [torch.zeros(B, tm.kv_heads, S, tm.head_dim, dtype=dtype, **z) if a else None for a in kv]
        m, mamba = tm.mamba, [kind == "mamba" for kind in tm.kinds]
        # a Mamba layer's states: its convolution's last inputs, and the SSM state (float32, as transformers keeps it)
        self.conv = [torch.zeros(B, m.conv_dim, m.kernel, dtype=dtype, **z) if a else None for a in mamba]
        self.ssm = [torch.zeros(B, m.heads, m.head_dim, m.state, dtype=torch.float32, **z) if a else None
                    for a in mamba]
        self.x = torch.zeros(B, 1, tm.embed.weight.shape[1], dtype=dtype, **z)  # hidden state between graph runs
        self.live = torch.zeros(B, dtype=torch.long, **z)  # rows generating this step, between graph runs
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
        self.graphs: dict[int, _Replay] = {}  # attention window -> the step that attends over it
        self.pool = None  # the graphs' memory pool: shared by this state's graphs only, freed with them

    def take_rows(self, src: _State, rows: list[int], pad: int) -> None:
        """Rows `rows` of `src` (a larger batch bucket of the same lengths) become rows 0.. of this state, in
        that order; the rest are empty and finished."""
        self.done.fill_(True)
        self.valid.zero_()
        self.tokens.fill_(pad)
        n = len(rows)
        if not n:
            return
        idx = torch.tensor(rows, device=self.done.device)
        for i in range(len(src.k)):
            if src.k[i] is not None:
                self.k[i][:n, :, :src.S] = src.k[i][idx]
                self.v[i][:n, :, :src.S] = src.v[i][idx]
            if src.conv[i] is not None:
                self.conv[i][:n] = src.conv[i][idx]
                self.ssm[i][:n] = src.ssm[i][idx]
        self.valid[:n, :src.S] = src.valid[idx]
        for name in ("logits", "pos", "col", "step", "cap", "seeds", "done"):
            getattr(self, name)[:n] = getattr(src, name)[idx]
        self.tokens[:n, :src.T] = src.tokens[idx, :src.T]
        self.logprobs[:n, :src.T] = src.logprobs[idx, :src.T]

    def written(self) -> list[torch.Tensor]:
        """The buffers a decode step writes, besides the KV cache column it rewrites (what capturing restores)."""
        states = [t for t in (*self.conv, *self.ssm) if t is not None]
        return [self.logits, self.pos, self.col, self.step, self.done, self.valid, self.tokens, self.logprobs,
                self.x, self.live, *states]


class _Replay:
    """One decode step as a sequence of captured graphs and the eager runs between them."""

    def __init__(self, parts: list):
        self.parts = parts

    def replay(self) -> None:
        for part in self.parts:
            part()


def _staged(step, *stages):
    """`step` (a partial or a function taking `stages=`) with each of its stages compiled."""
    return partial(step, stages=tuple(torch.compile(f, dynamic=False) for f in stages))


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

    Nemotron-H hybrids (`static_hybrid`) keep, per row, each Mamba layer's convolution and SSM states beside
    the attention layers' KV cache; a slot that takes a new request gets its prefill's states, so nothing
    carries over from the slot's last request. `moe` runs their experts `grouped` (one grouped matrix
    product over the chosen experts), `dense` (every expert, weighted) or `auto` (grouped on CUDA in
    bfloat16, else dense). `eager_layers` names layer kinds (`decoder`, `attention`, `mamba`, `moe`, `mlp`)
    that run outside the captured graphs, between their replays; a kind whose capture fails is added to them
    (with a warning that names it), so one uncapturable layer type does not cost the whole step its graphs.
    """

    BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    LENGTH_BUCKET = 64
    ATTENTION_CHUNK = 32

    def __init__(self, model, tokenizer, adapter, *, seed: int = 0, max_cached_images: int = 4096,
                 cuda_graphs: bool | None = None, sync_every: int = 16, max_states: int = 4,
                 compile: bool | None = None, fuse_weights: bool = True, chat_template: str | None = None,
                 attention: str = "auto", max_batch: int = default(GenerationSection, "max_batch"),
                 max_cache_fraction: float | None = 0.4,
                 join_every: int | None = None, moe: str = "auto", eager_layers: tuple[str, ...] = ()):
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
        self._rms = hybrid.rms if tm.is_hybrid else _rms
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
        if moe not in hybrid.MOE_KERNELS:
            raise GymvError(f"decode experts must be one of {', '.join(hybrid.MOE_KERNELS)}, got {moe!r}",
                            where="StaticDecodeBackend(moe=...)", fix="use auto, grouped or dense")
        self._grouped_moe = moe == "grouped" or (moe == "auto"
                                                 and hybrid.grouped_available(self.device, tm.embed.weight.dtype))
        odd = sorted(set(eager_layers) - set(tm.kinds))
        if odd:
            raise GymvError(f"eager_layers names layer kinds this model does not have: {', '.join(odd)}",
                            where="StaticDecodeBackend(eager_layers=...)",
                            fix=f"use some of: {', '.join(sorted(set(tm.kinds)))}")
        self.eager_layers = set(eager_layers)
        self.compile = (self.device.type == "cuda") if compile is None else compile
        self._set_functions(self.compile)

    COMPILED_VARIANTS = len(BATCH_BUCKETS) * 3  # per function: a graph per batch bucket and sampling mode

    def _set_functions(self, compiled: bool) -> None:
        # the SSM state's update through mamba_ssm's Triton kernel on CUDA where it imports (else the torch step)
        kernels = mamba_kernels.load(self.device) if "mamba" in self.tm.kinds else None
        mamba = hybrid.mamba_step if kernels is None else \
            partial(hybrid.mamba_step, ssm_update=hybrid.ssm_update_triton(kernels.state_update))
        moe = hybrid.moe_step
        fns = (_layer_pre, _layer_post, _lm_head, _draw, _attn_out, hybrid.mlp_step)
        if compiled:
            lift_recompile_limit(self.COMPILED_VARIANTS)
            fns = tuple(torch.compile(f, dynamic=False) for f in fns)
            # the grouped experts and the Triton state update run as they are, between two compiled stages of
            # their block (its norms, router, convolution, gated norm, shared expert: kernels to fuse)
            moe = _staged(moe, hybrid.moe_in, hybrid.moe_out) if self._grouped_moe else torch.compile(moe, dynamic=False)
            mamba = _staged(mamba, hybrid.mamba_in, hybrid.mamba_out) if kernels is not None \
                else torch.compile(mamba, dynamic=False)
        self._pre, self._post, self._head, self._draw, self._attn_out, self._mlp = fns
        self._mamba, self._moe = mamba, moe

    # -- the decode step -----------------------------------------------------------------------------
    def _runs(self) -> list[tuple[int, int, bool]]:
        """The step's parts (0: sampling and embedding, 1..n: the layers, n + 1: the LM head and counters) in
        runs [lo, hi) that are captured together or, for layers of a kind in `eager_layers`, run eagerly."""
        runs: list[tuple[int, int, bool]] = []
        for i, captured in enumerate([True, *(kind not in self.eager_layers for kind in self.tm.kinds), True]):
            if runs and runs[-1][2] == captured:
                runs[-1] = (runs[-1][0], i + 1, captured)
            else:
                runs.append((i, i + 1, captured))
        return runs

    def _decode_step(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        """Sample one token per row and feed it; a finished row stays where it is (it writes a pad to column T
        of its tokens, or past its last one, and rewrites one unused cache column)."""
        for lo, hi, _ in self._runs():
            self._run(st, lo, hi, greedy, nucleus, window)

    def _run(self, st: _State, lo: int, hi: int, greedy: bool, nucleus: bool, window: int) -> None:
        """Parts [lo, hi) of one decode step (see `_runs`); between runs, the hidden state and the rows still
        generating wait in `st.x` and `st.live`. Attention reads the cache's first `window` columns."""
        n = len(self._fused)
        if lo == 0:
            tok, live = self._sample(st, greedy, nucleus)
            x = self.tm.embed(tok[:, None])
            st.valid.scatter_(1, st.col[:, None], True)
            if hi < n + 2:
                st.live.copy_(live)
        else:
            x, live = st.x, st.live
        layers = range(max(lo, 1) - 1, min(hi, n + 1) - 1)
        if len(layers):
            x = self._layers(st, x, layers, window)
        if hi < n + 2:
            st.x.copy_(x)
            return
        st.logits.copy_(self._head(x, self.tm.norm.weight, self.tm.lm_head.weight, eps=self.tm.eps, rms=self._rms))
        live = live.long()
        st.step += live
        st.col += live
        st.pos += live

    def _layers(self, st: _State, x: torch.Tensor, layers: range, window: int) -> torch.Tensor:
        """The hidden state [B, 1, D] after `layers`, each feeding one token per row at that row's column
        `st.col` (< `window`), rotary positions `st.pos`."""
        tm = self.tm
        ctx = self._attention_inputs(st, x, window) if any(map(tm.has_kv, layers)) else None
        for i in layers:
            kind, w, act = self._fused[i]
            w = tuple(torch.cat(t) if isinstance(t, list) else t for t in w)
            if kind == "mamba":
                x = self._mamba(x, st.conv[i], st.ssm[i], *w, shape=tm.mamba, eps=tm.eps)
            elif kind == "moe":
                x = self._moe(x, *w, shape=tm.moe, act=act, grouped=self._grouped_moe, eps=tm.eps)
            elif kind == "mlp":
                x = self._mlp(x, *w, act=act, eps=tm.eps)
            else:
                x = self._attend(st, i, x, kind, w, act, ctx, window)
        return x

    def _attention_inputs(self, st: _State, x: torch.Tensor, window: int) -> tuple:
        """(cos, sin) of the rows' rotary positions (None without rotary), where each row's new key and value
        go, and the mask bias over the window (None for the split kernel, which reads `st.valid`)."""
        tm = self.tm
        cos = sin = None
        if tm.rotary is not None:
            cos, sin = tm.rotary(x, st.pos[:, None])
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, head_dim]
        B, S = st.valid.shape[0], st.S
        # each (row, kv head)'s new key lands in row (b * heads + h) * S + col of the cache seen as [B*H*S, D]
        at = ((torch.arange(B * tm.kv_heads, device=x.device).view(B, -1) * S) + st.col[:, None]).view(-1)
        bias = None
        if not self._split_attention:
            bias = torch.zeros(B, 1, 1, window, dtype=x.dtype, device=x.device)
            bias = bias.masked_fill(~st.valid[:, None, None, :window], float("-inf"))
        return cos, sin, at, bias

    def _attend(self, st: _State, i: int, x: torch.Tensor, kind: str, w: tuple, act, ctx: tuple,
                window: int) -> torch.Tensor:
        """One attention layer (a Llama-family `decoder` layer: with its MLP) over the static cache."""
        tm, (cos, sin, at, bias), D = self.tm, ctx, self.tm.head_dim
        q, k, v = self._pre(x, cos, sin, *w[:5], heads=tm.heads, kv_heads=tm.kv_heads, head_dim=D, eps=tm.eps,
                            rms=self._rms)
        st.k[i].view(-1, D).index_copy_(0, at, k.reshape(-1, D))
        st.v[i].view(-1, D).index_copy_(0, at, v.reshape(-1, D))
        if self._split_attention:
            o = split_attention(q.contiguous(), st.k[i], st.v[i], st.valid, window, tm.scale)
        else:
            o = F.scaled_dot_product_attention(q, st.k[i][:, :, :window], st.v[i][:, :, :window], attn_mask=bias,
                                               scale=tm.scale)
        if kind == "decoder":
            return self._post(x, o, *w[5:], act=act, eps=tm.eps)
        return self._attn_out(x, o, *w[5:])

    def _fuse(self) -> None:
        """Per layer, its kind, the tensors the step reads and its activation: the model's own parameters,
        q/k/v and gate/up as views of one tensor each (`fuse_weights`) or as lists concatenated at each step.
        Redone, and the graphs that read the old memory dropped, when a parameter no longer lies where it did
        (it was replaced)."""
        if self._fused and self._where() == self._fused_at:
            return
        self.drop_graphs()
        self._fused = []
        join = _fuse_params if self.fuse_weights else list
        acts: dict[str, Any] = {}  # one activation object per kind: a compiled step guards on its identity
        for kind, layer in zip(self.tm.kinds, self.tm.layers):
            act = acts.setdefault(kind, layer.mlp.act_fn if kind == "decoder" else hybrid.activation(kind, layer))
            if kind != "decoder":
                self._fused.append((kind, hybrid.layer_tensors(kind, layer, join), act))
                continue
            a, m = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            self._fused.append((kind, (layer.input_layernorm.weight, join([p.weight for p in qkv]),
                                       join([p.bias for p in qkv]) if a.q_proj.bias is not None else None,
                                       getattr(getattr(a, "q_norm", None), "weight", None),
                                       getattr(getattr(a, "k_norm", None), "weight", None),
                                       a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight,
                                       join([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight), act))
        self._fused_at = self._where()

    def _where(self) -> list[int]:
        """The address of every tensor of the text model a captured step reads."""
        mods = [self.tm.embed, self.tm.norm, self.tm.lm_head, self.tm.rotary, *self.tm.layers]
        return [t.data_ptr() for m in mods if m is not None for t in (*m.parameters(), *m.buffers())]

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

    def _capture(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        """Capture one decode step: each captured run of `_runs` becomes a graph, the other runs go between
        their replays. Buffers are saved and restored around the warm-up step (which also compiles), so
        capturing changes nothing a later step reads."""
        kept = st.written()
        saved = [t.clone() for t in kept]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one warm-up step, at the column the first real step rewrites
            self._decode_step(st, greedy, nucleus, window)
        torch.cuda.current_stream().wait_stream(side)
        if st.pool is None:
            st.pool = torch.cuda.graph_pool_handle()
        parts = []
        for lo, hi, captured in self._runs():
            part = partial(self._run, st, lo, hi, greedy, nucleus, window)
            if captured:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=st.pool, capture_error_mode="thread_local"):
                    part()
                part = g.replay
            parts.append(part)
        for t, s in zip(kept, saved):
            t.copy_(s)
        st.graphs[window] = _Replay(parts)

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
        dtype = self.tm.embed.weight.dtype
        st = _State(self.tm, B, S, T, vocab, dtype, self.device)
        self._states[(B, S, T, vocab, greedy, nucleus)] = st
        return st, True

    def drop_graphs(self) -> None:
        """Free every static cache and captured graph (e.g. before training shares the GPU)."""
        self._states.clear()

    # -- generation ----------------------------------------------------------------------------------
    def _prefill(self, requests: list[GenerationRequest]) -> tuple[list, torch.Tensor, torch.Tensor, list[int], int]:
        """One prefill pass over the distinct (prompt, images) of `requests`, left-padded to their longest:
        (per-layer states (`_cache_states`), last logits [U, V], mask [U, L], each request's prefill row, L)."""
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
        self._times["prefill_rows"] += len(prompts)
        input_ids, mask = left_pad(prompts, self._pad)
        L = input_ids.shape[1]
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = self.adapter.position_ids(model, input_ids, mask, grid)
        cache = DynamicCache(config=model.config)
        logits = forward_logits(model, input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                image_token_id=self.adapter.image_token_id, features=feats, cache=cache,
                                logits_to_keep=1, extra=_forward_kwargs(self.adapter, input_ids),
                                adapter=self.adapter)[:, -1]
        return _cache_states(cache, self.tm), logits, mask, row_slot, L

    def _fill(self, st: _State, slots: list[int], requests: list[GenerationRequest], seeds: torch.Tensor,
              caps: list[int]) -> int:
        """Prefill `requests` into rows `slots` of the static cache (columns 0..L-1, L their longest prompt) and
        Mamba states: each row starts its own count, seed and token cap. Returns L."""
        dev, t0, enc = self.device, time.perf_counter(), self._times["encode_s"]
        kv, logits, mask, row_slot, L = self._prefill(requests)
        # a slot's Mamba states are overwritten, not continued: each request starts from its own prefill
        rows = torch.tensor(row_slot, device=dev)
        at = torch.tensor(slots, device=dev)
        for i, (k, v) in enumerate(kv):  # keys and values, or a Mamba layer's convolution and SSM states
            if st.k[i] is not None:
                st.k[i][:, :, :L].index_copy_(0, at, k[rows].to(st.k[i].dtype))
                st.v[i][:, :, :L].index_copy_(0, at, v[rows].to(st.v[i].dtype))
            elif st.conv[i] is not None:
                st.conv[i].index_copy_(0, at, k[rows].to(st.conv[i].dtype))
                st.ssm[i].index_copy_(0, at, v[rows].to(st.ssm[i].dtype))
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
        per_row = self.tm.row_bytes(S, self.tm.embed.weight.element_size())
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
        self._times = {"encode_s": 0.0, "prefill_s": 0.0, "prefill_rows": 0}
        self._pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        usable = max(1, min(self.max_batch, slots or self.max_batch))
        if max_len is not None:
            usable = self._rows_that_fit(usable, self._cache_len(max_len))
        first = feed.take(usable, block=True)
        if not first or feed.cancelled:
            return
        session = _Session(self, feed, params, on_output, usable)
        session.start(first, max_len)
        session.run()
        self.last_timing = session.timing(t0)

    def _capture_or_uncompile(self, st: _State, greedy: bool, nucleus: bool, window: int) -> None:
        """Capture; if that fails, capture again with the split attention kernel off (SDPA), then uncompiled,
        then with the layer kinds that cannot be captured on their own left to run eagerly."""
        try:
            self._capture(st, greedy, nucleus, window)
        except Exception as e:  # noqa: BLE001 - a kernel or compiler failing must not stop generation
            import warnings

            if self._split_attention:
                what = "the split decode-attention kernel failed; decoding with SDPA"
                self._split_attention = False
            elif self.compile:
                what = "torch.compile of the decode step failed; decoding uncompiled"
                self.compile = False
                self._set_functions(False)
            else:
                failing = self._uncapturable(st, greedy, nucleus, window)
                if not failing:
                    raise
                what = f"{', '.join(sorted(failing))} layers cannot be captured in a CUDA graph; they run eagerly"
                self.eager_layers |= failing
            warnings.warn(f"{what} ({type(e).__name__}: {e})", stacklevel=2)
            st.graphs.clear()
            st.pool = None
            self._capture_or_uncompile(st, greedy, nucleus, window)

    def _uncapturable(self, st: _State, greedy: bool, nucleus: bool, window: int) -> set[str]:
        """The layer kinds, of those still captured, whose capture fails with every other kind left eager."""
        base, kinds = set(self.eager_layers), set(self.tm.kinds) - self.eager_layers
        failing = set()
        for kind in sorted(kinds):
            self.eager_layers = base | (kinds - {kind})
            try:
                self._capture(st, greedy, nucleus, window)
            except Exception:  # noqa: BLE001 - this kind is the one that fails
                failing.add(kind)
            st.graphs.clear()
        self.eager_layers = base
        return failing

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


class _Session:
    """One `serve` call: the slots, which request each serves and since when, and the decode loop over them.

    A slot's bookkeeping lives in lists indexed by slot (`slot_req`, `filled_at`, `start_col`, `checked`,
    `cap_of`); `live` are the slots still decoding a request, `parked` the finished ones read out at the end
    (once nothing more can come, no sync is needed to free them)."""

    def __init__(self, backend: StaticDecodeBackend, feed: RequestFeed, params: SamplingParams,
                 on_output: OnOutput, usable: int):
        self.backend, self.feed, self.params, self.on_output = backend, feed, params, on_output
        self.dev, self.pad, self.usable = backend.device, backend._pad, usable
        self.T = params.max_new_tokens
        self.greedy, self.nucleus = params.temperature == 0, params.top_p < 1.0
        self.stop = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(backend.eos_token_ids)))
        self.stop_set = set(self.stop)
        self.stop_strings = tuple(x for x in params.stop_strings if x)
        self.windows_of = {s: len(s.encode("utf-8")) + 1 for s in self.stop_strings}
        self.keys: dict[int, Any] = {}  # arrival index -> the caller's key
        self.caps: list[int] = []  # arrival index -> token cap
        self.cut: dict[int, int] = {}  # request -> length where a stop string ended it (found mid-loop)
        self.use_graph = backend.cuda_graphs and self.dev.type == "cuda"
        self.pinned = self.dev.type == "cuda"
        self.capture_s = self.refill_s = self.idle_s = self.handoff_s = 0.0
        self.steps = self.refills = self.refill_calls = self.joined = self.repacks = 0  # joined: while others decoded
        self.new_tokens = self.row_steps = self.last_join = 0
        self.pending: torch.cuda.Event | None = None
        self.live: list[int] = []
        self.parked: list[int] = []
        self.hi_base = self.hi_cap = 0

    def start(self, first: list, max_len: int | None) -> None:
        """The batch bucket and cache for the first requests, prefilled together."""
        b, dev, T = self.backend, self.dev, self.T
        self.Bb = Bb = _bucket(self.usable, b.BATCH_BUCKETS)
        if max_len is None:
            max_len = max(len(r.prompt_token_ids) for _, r in first) + T
        b._fuse()
        self.vocab = vocab = b.tm.lm_head.weight.shape[0]
        st, _ = b._state(Bb, b._cache_len(max_len), -(-T // b.LENGTH_BUCKET) * b.LENGTH_BUCKET, vocab,
                         self.greedy, self.nucleus)
        self.st = st
        if b._forbidden is None or b._forbidden.shape[0] != vocab:
            b._forbidden = forbidden_mask(vocab, b.adapter.vision_token_ids, dev)
        self.setup(st)
        ids0, reqs0, seeds0 = self.admit(first)
        n0 = len(ids0)
        # rows beyond the first requests (bucket padding, free slots) copy request 0 and start finished
        rows0 = list(range(n0)) + [0] * (Bb - n0)
        L = b._fill(st, list(range(Bb)), [reqs0[i] for i in rows0], seeds0[torch.tensor(rows0, device=dev)],
                    [self.caps[i] for i in rows0])
        if Bb > n0:
            st.done[n0:] = True
        self.t_prefill = time.perf_counter()
        self.slot_req: list[int | None] = ids0 + [None] * (Bb - n0)
        self.cap_of = [self.caps[0]] * Bb
        for s_, r in enumerate(ids0):
            self.cap_of[s_] = self.caps[r]
        self.filled_at = [0] * Bb  # the step count when the slot took its request
        self.start_col = [L] * Bb
        self.checked = [0] * Bb  # tokens of the slot's request already searched for stop strings
        self.host_done, self.host_tokens, self.host_step = self.host_buffers(Bb, st)

    def setup(self, state: _State) -> None:
        """The sampling settings and stop ids of this call, in `state`'s buffers."""
        dev, stop = self.dev, self.stop
        state.pad = self.pad
        state.temperature.fill_(1.0 if self.greedy else float(self.params.temperature))
        state.top_p.fill_(float(self.params.top_p))
        if len(stop) > state.stop_ids.numel():
            state.stop_ids = torch.full((len(stop),), -1, dtype=torch.long, device=dev)
            state.graphs.clear()
        state.stop_ids.fill_(-1)
        if stop:
            state.stop_ids[:len(stop)] = torch.tensor(stop, device=dev)

    def admit(self, batch: list) -> tuple[list[int], list[GenerationRequest], torch.Tensor]:
        """Arrival indices, requests and row seeds of `batch`, each request checked and given its token cap."""
        start, caps = len(self.caps), self.caps
        reqs = [r for _, r in batch]
        for i, (key, r) in enumerate(batch):
            caps.append(self.backend._admit(key, r, self.st.S, self.T))
            self.keys[start + i] = key
        return list(range(start, len(caps))), reqs, self.backend._seeds(reqs, start, self.params.seed)

    def host_buffers(self, B: int, state: _State) -> tuple:
        """Pinned host copies of the finished flags (and, for stop strings, tokens and counts)."""
        pinned, strings = self.pinned, self.stop_strings
        return (torch.zeros(B, dtype=torch.bool, pin_memory=pinned),
                torch.zeros(B, state.T + 1, dtype=torch.long, pin_memory=pinned) if strings else None,
                torch.zeros(B, dtype=torch.long, pin_memory=pinned) if strings else None)

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        """Decode until the feed is exhausted and every request has been handed back, or it is cancelled."""
        feed = self.feed
        self.refresh()
        while not feed.cancelled:
            if not self.live:
                if not self.wait():
                    break
                continue
            if self.last_step_due():
                self.last_step()
                break
            self.step()
            spent = all(self.steps - self.filled_at[s_] >= self.cap_of[s_] for s_ in self.live)
            if self.steps % self.backend.sync_every and not spent:
                continue
            flags = self.read_flags(spent)
            if flags is not None:
                self.check(*flags)
        if self.parked and not feed.cancelled:
            self.harvest(self.parked)

    def wait(self) -> bool:
        """Nothing to decode: shrink, then block until the caller feeds requests; False when none will come."""
        self.repack()
        ti = time.perf_counter()
        batch = self.feed.take(self.usable, block=True)
        self.idle_s += time.perf_counter() - ti
        if not batch or self.feed.cancelled:
            return False
        self.refill(batch)
        self.refresh()
        return True

    def last_step_due(self) -> bool:
        """Every live row draws its last token now and nothing more can come: no token is left to feed."""
        steps = self.steps
        return all(steps - self.filled_at[s_] == self.cap_of[s_] - 1 for s_ in self.live) and self.feed.exhausted()

    def last_step(self) -> None:
        _, going = self.backend._sample(self.st, self.greedy, self.nucleus)
        self.st.step += going.long()
        self.harvest(self.live + self.parked)
        self.parked = []
        self.steps += 1
        self.row_steps += self.Bb

    def step(self) -> None:
        """One decode step, a graph replay where graphs are on (captured at a window's first step)."""
        b, st = self.backend, self.st
        C = b.ATTENTION_CHUNK
        window = min(st.S, min(self.hi_base + self.steps, self.hi_cap) // C * C + C)
        if self.use_graph:
            if window not in st.graphs:
                tc = time.perf_counter()
                b._capture_or_uncompile(st, self.greedy, self.nucleus, window)
                self.capture_s += time.perf_counter() - tc
            st.graphs[window].replay()
        else:
            b._decode_step(st, self.greedy, self.nucleus, window)
        self.steps += 1
        self.row_steps += self.Bb

    def read_flags(self, spent: bool) -> tuple | None:
        """(finished flags, tokens, counts) for a check; on CUDA as of the previous check (the GPU keeps a
        step group queued), None at the first check, which only queues the copy."""
        st = self.st
        if self.dev.type == "cuda" and not spent:
            seen = self.pending is not None
            flags = None
            if seen:
                self.pending.synchronize()
                strings = self.stop_strings
                flags = (self.host_done.clone(), self.host_tokens.clone() if strings else None,
                         self.host_step.clone() if strings else None)
            self.snapshot()
            return flags
        if self.stop_strings:
            return st.done.cpu(), st.tokens.cpu(), st.step.cpu()
        return st.done.cpu(), None, None

    def check(self, done_now: torch.Tensor, toks_now: torch.Tensor | None, step_now: torch.Tensor | None) -> None:
        """Cut rows at stop strings, hand back (or park) finished rows, refill free slots, shrink the batch."""
        if self.stop_strings:
            done_now = self.cut_stop_strings(done_now, toks_now, step_now)
        steps, live, feed = self.steps, self.live, self.feed
        finished = [s_ for s_ in live if bool(done_now[s_]) or steps - self.filled_at[s_] >= self.cap_of[s_]]
        if finished:
            if feed.exhausted():
                self.parked += finished
            else:
                self.harvest(finished)
        join_every = self.backend.join_every
        due = join_every is None or steps - self.last_join >= join_every
        free = sum(self.slot_req[s_] is None for s_ in range(self.usable))
        if due and not feed.exhausted() and free:
            batch = feed.take(free, block=False)
            if batch:
                self.refill(batch)
        self.repack()
        self.refresh()

    def cut_stop_strings(self, done_now: torch.Tensor, toks_now: torch.Tensor, step_now: torch.Tensor
                         ) -> torch.Tensor:
        """Search the tokens each live row made since the last check for a stop string; a row that ends on one
        is marked finished (on the device too) and its cut recorded. The finished flags, updated."""
        ended = []
        for s_ in self.live:
            r = self.slot_req[s_]
            if bool(done_now[s_]) or r in self.cut:
                continue
            row, n = toks_now[s_].tolist(), int(step_now[s_])
            for j in range(self.checked[s_], n):
                if self.backend._stop_string(row[:j + 1], self.stop_strings, self.windows_of) is not None:
                    self.cut[r] = j + 1
                    ended.append(s_)
                    break
            self.checked[s_] = n
        if ended:
            self.st.done.index_fill_(0, torch.tensor(ended, device=self.dev), True)
            done_now = done_now.clone()
            done_now[ended] = True
        return done_now

    # -- slots ---------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Per-step bounds over the slots still serving a request: the newest column any may write, and
        the step by which all have hit their token budget."""
        self.live = live = [s_ for s_ in range(self.Bb) if self.slot_req[s_] is not None and s_ not in self.parked]
        if live:
            self.hi_base = max(self.start_col[s_] - self.filled_at[s_] for s_ in live)
            self.hi_cap = max(self.start_col[s_] + self.cap_of[s_] for s_ in live)

    def harvest(self, slot_ids: list[int]) -> None:
        """Read the rows out and hand each output back (a sync with the device)."""
        th = time.perf_counter()
        st = self.st
        idx = torch.tensor(slot_ids, device=self.dev)
        toks, lps, lens = st.tokens[idx].tolist(), st.logprobs[idx].tolist(), st.step[idx].tolist()
        for j, s_ in enumerate(slot_ids):
            r = self.slot_req[s_]
            n = min(lens[j], self.cut.get(r, lens[j]))
            out = self.backend._finish(toks[j][:n], lps[j][:n], n, self.stop_set, self.params)
            self.new_tokens += len(out.token_ids)
            self.slot_req[s_] = None
            self.on_output(self.keys.pop(r), out)
        self.handoff_s += time.perf_counter() - th

    def snapshot(self) -> None:
        """Queue a copy of the finished flags (and tokens, for stop strings) for the next check to read."""
        st = self.st
        self.host_done.copy_(st.done, non_blocking=True)
        if self.stop_strings:
            self.host_tokens.copy_(st.tokens, non_blocking=True)
            self.host_step.copy_(st.step, non_blocking=True)
        self.pending = torch.cuda.Event()
        self.pending.record()

    def refill(self, batch: list) -> None:
        """Prefill `batch` into free slots; each starts its own count there."""
        tr, steps = time.perf_counter(), self.steps
        free = [s_ for s_ in range(self.usable) if self.slot_req[s_] is None]
        ids, reqs, seeds = self.admit(batch)
        take = free[:len(ids)]
        Lf = self.backend._fill(self.st, take, reqs, seeds, [self.caps[r] for r in ids])
        for s_, r in zip(take, ids):
            self.slot_req[s_], self.filled_at[s_], self.start_col[s_] = r, steps, Lf
            self.checked[s_], self.cap_of[s_] = 0, self.caps[r]
        self.refills += len(take)
        self.refill_calls += 1
        self.last_join = steps
        if any(self.slot_req[s_] is not None for s_ in range(self.Bb) if s_ not in take):
            self.joined += len(take)
        if self.dev.type == "cuda":  # flags copied before the refill describe the slots' old requests
            self.snapshot()
        self.refill_s += time.perf_counter() - tr

    def repack(self) -> None:
        """Move the rows still serving a request into the smallest batch bucket that holds every request
        that may still come (`feed.open_keys`), when that is smaller than the current one: a session's
        tail, its few longest episodes, then decodes on fewer rows."""
        open_keys, st = self.feed.open_keys, self.st
        src = [s_ for s_ in range(self.Bb) if self.slot_req[s_] is not None]
        b = self.backend
        if open_keys is None or self.parked or _bucket(max(1, open_keys, len(src)), b.BATCH_BUCKETS) >= self.Bb:
            return
        tr = time.perf_counter()
        B2 = _bucket(max(1, open_keys, len(src)), b.BATCH_BUCKETS)
        st2, _ = b._state(B2, st.S, st.T, self.vocab, self.greedy, self.nucleus)
        self.setup(st2)
        st2.take_rows(st, src, self.pad)
        moved = src + [None] * (B2 - len(src))
        self.slot_req = [None if s_ is None else self.slot_req[s_] for s_ in moved]
        self.filled_at, self.start_col, self.checked, self.cap_of = (
            [0 if s_ is None else xs[s_] for s_ in moved]
            for xs in (self.filled_at, self.start_col, self.checked, self.cap_of))
        self.st, self.Bb, self.usable = st2, B2, min(self.usable, B2)
        self.host_done, self.host_tokens, self.host_step = self.host_buffers(B2, st2)
        if self.dev.type == "cuda":
            self.snapshot()
        self.repacks += 1
        self.refill_s += time.perf_counter() - tr

    def timing(self, t0: float) -> dict[str, Any]:
        """Where the call's time went (`last_timing`)."""
        t_end = time.perf_counter()
        busy = self.capture_s + self.refill_s + self.idle_s + self.handoff_s
        return {**self.backend._times, "capture_s": self.capture_s, "decode_s": t_end - self.t_prefill - busy,
                "refill_s": self.refill_s, "idle_s": self.idle_s, "handoff_s": self.handoff_s, "total_s": t_end - t0,
                "new_tokens": self.new_tokens, "decode_steps": self.steps, "batch": len(self.caps),
                "batch_bucket": self.Bb, "slots": self.usable, "cache_len": self.st.S, "refills": self.refills,
                "refill_calls": self.refill_calls, "joined": self.joined, "repacks": self.repacks,
                "row_steps": self.row_steps, "eager_layers": sorted(self.backend.eager_layers)}


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


def _layer_pre(x, cos, sin, ln, wqkv, bqkv, qn, kn, *, heads: int, kv_heads: int, head_dim: int, eps: float,
               rms=_rms):
    """Norm, projections and rotary (where `cos` is given) of one token per row: q [B, kv heads, heads per kv
    head, d], k and v [B, kv heads, 1, d]; the query heads that share a kv head attend as one short sequence
    against it."""
    B = x.shape[0]
    h = rms(x, ln, eps)
    qkv = F.linear(h, wqkv, bqkv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(B, 1, heads, head_dim)
    k = k.view(B, 1, kv_heads, head_dim)
    v = v.view(B, 1, kv_heads, head_dim).transpose(1, 2)
    if qn is not None:
        q, k = _rms(q, qn, eps), _rms(k, kn, eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if cos is not None:
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
    return q.reshape(B, kv_heads, heads // kv_heads, head_dim), k, v


def _attn_out(x, o, wo, bo):
    """Output projection and residual."""
    return x + F.linear(o.reshape(x.shape[0], 1, -1), wo, bo)


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


def _lm_head(x, norm, head, *, eps: float, rms=_rms):
    return F.linear(rms(x, norm, eps), head)[:, 0].float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cache_states(cache, tm: TextModel) -> list[tuple]:
    """Per layer, what a prefill left in a transformers DynamicCache (5.x layouts): keys and values
    [B, kv heads, L, head dim] of an attention layer, the convolution [B, channels, kernel] and SSM
    [B, heads, head dim, state] states of a Mamba layer, (None, None) for the others."""
    if not hasattr(cache, "layers"):
        if tm.is_hybrid:
            raise GymvError("this transformers keeps Nemotron-H states in a cache layout the static decoder "
                            "does not read", where="generation.decode",
                            fix="use generation.decode=eager, or a transformers whose DynamicCache has layers")
        return list(zip(cache.key_cache[:len(tm.kinds)], cache.value_cache[:len(tm.kinds)]))
    out = []
    for i, layer in enumerate(cache.layers[:len(tm.kinds)]):
        if tm.has_kv(i):
            out.append((layer.keys, layer.values))
        elif tm.kinds[i] == "mamba":
            out.append((layer.conv_states[0], layer.recurrent_states[0]))
        else:
            out.append((None, None))
    return out


DECODE_MODES = ("auto", "eager", "static")


def with_decode(backend, decode: str = "auto", *, seed: int = 0,
                max_batch: int = default(GenerationSection, "max_batch")):
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
