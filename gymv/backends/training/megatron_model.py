"""A Megatron-core GPTModel (local layer spec: plain torch modules, no Transformer Engine, no apex) built from an
HF decoder config, and a thin module that gives it the HF causal-LM call (input_ids or inputs_embeds,
attention_mask -> .logits [B,T,V]) that gymv's logprob functions make.

megatron-core assumes CUDA in four places a training forward reaches: the rotary table moves itself to
`torch.cuda.current_device()`, the multimodal (3-D) rotary table is built there, attention scores go into a
scratch buffer allocated there, and attention dropout forks a CUDA RNG state. For a CPU model, `allow_cpu`
replaces those four (tables and buffer stay on the CPU; dropout, which gymv leaves at 0, draws from the CPU
generator), and tensor-parallel logits are gathered by gymv (megatron's gather allocates on CUDA too), so
CI runs the same model on CPU with gloo.
"""

from __future__ import annotations

import contextlib
import datetime
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from gymv.backends import packed_attention
from gymv.backends.moe_router import RouterReplica
from gymv.backends.packing import PackedAttentionArgs
from gymv.backends.registry import MEGATRON
from gymv.backends.training.megatron_weights import DecoderShape
from gymv.errors import GymvError
from gymv.net import master_store

_PRIVATE_STORE = None
_CPU_ALLOWED = False
_MODE: str | None = None  # the device type megatron's state in this process was built for


def require_megatron():
    """Import megatron-core and the modules gymv builds with once, quietly: without Transformer Engine and
    apex every module warns that it falls back to torch, which is what gymv asks of it."""
    import sys
    import warnings

    first = "megatron.core" not in sys.modules
    with warnings.catch_warnings(), (_fusions_eager() if first and not torch.cuda.is_available()
                                     else contextlib.nullcontext()):
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
        try:
            import megatron.core
            import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        except ImportError as e:
            raise GymvError("training.backend megatron needs megatron-core", where="training.backend",
                            fix=MEGATRON.fix) from e
    return megatron.core


@contextlib.contextmanager
def _fusions_eager():
    """torch.compile as the identity while megatron-core imports on a machine without CUDA: its modules wrap
    their small fused functions (bias + activation, routing maps) in torch.compile as they import
    (megatron.core.jit), which loads torch's dynamo and inductor: about 1.4 s of every CPU rank's start. Left
    plain they compute the same; a CPU run is a test or tiny run, where compiling them would cost more than
    it saves."""
    compile_ = torch.compile
    torch.compile = lambda fn=None, *args, **kwargs: fn if fn is not None else (lambda f: f)
    try:
        yield
    finally:
        torch.compile = compile_


class _CpuRngTracker:
    """Stands in for megatron's CUDA RNG tracker on a CPU-only torch: forks keep the CPU generator."""

    def fork(self, name: str = ""):
        return contextlib.nullcontext()

    def is_initialized(self) -> bool:
        return True

    def add(self, name, seed) -> None:
        pass

    def reset(self) -> None:
        pass

    def get_states(self):
        return {}

    def set_states(self, states) -> None:
        pass


def _cpu_buffer():
    from megatron.core.utils import GlobalMemoryBuffer

    class CpuMemoryBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            n = 1
            for d in tensor_shape:
                n *= d
            held = self.buffer.get((name, dtype))
            if held is None or held.numel() < n:
                held = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
            return held[:n].view(*tensor_shape)

    return CpuMemoryBuffer()


def allow_cpu() -> None:
    """Let GPTModel's training forward run without CUDA (see the module docstring). Called by `init_parallel`
    for a CPU device, after megatron's parallel state is up (it replaces the state's scratch buffer)."""
    global _CPU_ALLOWED
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state._GLOBAL_MEMORY_BUFFER = _cpu_buffer()  # initialize_model_parallel makes a CUDA one each time
    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if _CPU_ALLOWED:
        return
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        if _MODE == "cuda" and self.inv_freq.device.type == "cpu":  # megatron's own move, in a CUDA process
            self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def mrope_init(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                   seq_len_interpolation_factor=None, rotary_base: int = 10000, cp_group=None) -> None:
        torch.nn.Module.__init__(self)
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        self.rotary_interleaved, self.seq_len_interpolation_factor = rotary_interleaved, seq_len_interpolation_factor
        device = torch.cuda.current_device() if _MODE == "cuda" else "cpu"
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group(
            check_initialized=False)

    rope.RotaryEmbedding.get_emb = get_emb
    rope.MultimodalRotaryEmbedding.__init__ = mrope_init
    _CPU_ALLOWED = True


def init_parallel(tensor_parallel: int, device: torch.device, seed: int = 0) -> None:
    """Megatron's model-parallel groups over the default process group (a private one-rank group on
    127.0.0.1 when none is up), for CPU or CUDA models; a process moving to the other device type (tests do)
    gets its private group and megatron's state rebuilt."""
    global _PRIVATE_STORE, _MODE
    import torch.distributed as dist

    require_megatron()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        held = parallel_state.get_tensor_model_parallel_world_size()
        if held != tensor_parallel:
            raise GymvError(f"this process already runs megatron with tensor parallel size {held}, not {tensor_parallel}",
                            where="training.parallel.tensor", fix="use one tensor parallel size per process")
        if _MODE == device.type:
            return
        if _PRIVATE_STORE is None:
            raise GymvError(f"megatron runs on {_MODE} in this process, not {device.type}", where="training.backend",
                            fix="use one device type per trainer process")
        release_parallel()
    if not dist.is_initialized():
        _PRIVATE_STORE = master_store("127.0.0.1", 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=_PRIVATE_STORE[0], rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=30))
    if dist.get_world_size() % tensor_parallel:
        raise GymvError(f"tensor parallel size {tensor_parallel} does not divide the {dist.get_world_size()} "
                        "trainer ranks", where="training.parallel.tensor", fix="use a divisor of the rank count")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    _MODE = device.type
    if device.type == "cuda":
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if isinstance(mrandom._CUDA_RNG_STATE_TRACKER, _CpuRngTracker):
            mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = None, False
        model_parallel_cuda_manual_seed(seed)
    else:
        allow_cpu()


def release_parallel() -> None:
    """Undo `init_parallel` in this process: megatron's groups, and the private process group if it made one."""
    global _PRIVATE_STORE, _MODE
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _MODE = None
    if _PRIVATE_STORE is not None:
        dist.destroy_process_group()
        _PRIVATE_STORE[1].close()
        _PRIVATE_STORE = None


class SdpaCoreAttention(torch.nn.Module):
    """Megatron's core-attention slot filled with PyTorch's fused scaled-dot-product attention (the local
    spec's own materialises every [heads, T, T] score matrix). Causal over each row: gymv's padded rows are
    right-padded, so every real position attends exactly as under the padding mask, and padded positions
    are never scored. A packed row arrives with its segments (gymv.backends.packing.PackedAttentionArgs) in
    the attention-mask argument, which megatron hands through every layer unchanged (and torch's checkpoint
    keeps for the recompute): each segment then attends to its own keys alone, through
    gymv.backends.packed_attention (varlen flash on CUDA, one SDPA call per segment elsewhere). No dropout
    (gymv trains at 0)."""

    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type: str = "self", **_: Any):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.softmax_scale = getattr(config, "softmax_scale", None)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None, **_: Any) -> Tensor:
        import torch.nn.functional as F

        sq, b = query.shape[:2]  # [sq, b, heads, dim]; key and value [sk, b, groups, dim]
        # one dtype for the fused kernel: the value's (the QKV projection's output, bf16 under autocast)
        q, k, v = (t.to(value.dtype).permute(1, 2, 0, 3) for t in (query, key, value))
        if isinstance(attention_mask, PackedAttentionArgs):
            out, _ = packed_attention.packed_attention_forward(self, q, k, v, None, scaling=self.softmax_scale,
                                                               **{packed_attention.KEYWORD: attention_mask})
            return out.reshape(sq, b, -1)  # [1, N, heads, dim] -> [N, 1, heads * dim]
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


@contextlib.contextmanager
def _rotary_at(gpt, positions: Tensor):
    """GPTModel's plain rotary table counts 0..T-1 over a row; a packed row's positions restart per sequence
    (or continue from a shared prompt). For one forward, the table hands each token the row of its own
    position instead (megatron applies a [T, 1, 1, dim] table token by token)."""
    rope = gpt.rotary_pos_emb
    # [N, 1, 1, dim], megatron's own table (cached by length); a position is below N, the row's length, as
    # every sequence (a shared prompt included) lies inside the row
    table = rope(positions.numel())
    at = table[positions.to(table.device)]
    rope.forward = lambda *args, **kwargs: at
    try:
        yield
    finally:
        del rope.forward


@contextlib.contextmanager
def _head_at(gpt, keep: int | Tensor):
    """For one forward, GPTModel's output layer runs on the kept positions alone (HF's `logits_to_keep`:
    the last `keep`, or the columns a 1-D tensor names): a loss scores the answer tokens only, and the head
    over the whole vocabulary is a large share of a step."""
    layer = gpt.output_layer
    inner = layer.forward

    def forward(hidden: Tensor, *args: Any, **kwargs: Any):  # hidden [T, B, H]
        picked = hidden[-keep:] if isinstance(keep, int) else hidden.index_select(0, keep.to(hidden.device))
        return inner(picked, *args, **kwargs)

    layer.forward = forward
    try:
        yield
    finally:
        del layer.forward


def _layer_spec(shape: DecoderShape, attention: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    elif attention != "local":
        raise GymvError(f"unknown megatron attention {attention!r}", where="megatron attention", fix="use sdpa or local")
    return spec


def _rope_theta(text) -> float:
    params = getattr(text, "rope_parameters", None) or {}
    scaling = getattr(text, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise GymvError(f"training.backend megatron supports plain rotary positions, not rope_type {kind!r}",
                        where="model.path config.json", fix="use training.backend: torch or fsdp2 for this model")
    return float(params.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0)


def build_gpt(hf_config: Any, shape: DecoderShape, *, tensor_parallel: int = 1, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu", max_positions: int | None = None, attention: str = "sdpa"):
    """An un-initialised-for-use GPTModel of the HF decoder's shape (load its weights with the mapping).
    `attention`: "sdpa" (fused, causal; see SdpaCoreAttention) or megatron's "local" one (masked)."""
    require_megatron()
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    device = torch.device(device)
    cfg = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=text.rms_norm_eps,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, tensor_model_parallel_size=tensor_parallel,
        use_cpu_initialization=device.type != "cuda", perform_initialization=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, attention_softmax_in_fp32=True,
        bf16=dtype == torch.bfloat16)
    if shape.mrope_section:
        cfg.mrope_section = list(shape.mrope_section)
    model = GPTModel(config=cfg, transformer_layer_spec=_layer_spec(shape, attention),
                     vocab_size=shape.vocab, max_sequence_length=max_positions or text.max_position_embeddings,
                     parallel_output=True, share_embeddings_and_output_weights=shape.tied,
                     position_embedding_type="mrope" if shape.mrope_section else "rope", rotary_base=_rope_theta(text))
    return model.to(device)


def checkpoint_layers(gpt) -> None:
    """Activation checkpointing, one decoder layer at a time, by torch's non-reentrant checkpoint (megatron's
    own recompute saves CUDA RNG states, so it cannot run on a CPU); the backward recomputes each layer."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for layer in gpt.decoder.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    gpt.gymv_checkpointed = True


def megatron_mask(mask: Tensor) -> Tensor:
    """Megatron's boolean mask [B,1,T,T] (True = not attended): causal, and never onto padding."""
    t = mask.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=mask.device).triu(1)
    return causal[None, None] | (mask == 0)[:, None, None, :]


class _GatherVocab(torch.autograd.Function):
    """Vocab-parallel logits [..., V/tp] -> full [..., V] on every TP rank. Backward keeps this rank's slice:
    every rank computes the same loss from the same gathered logits, so the slice is the whole gradient.
    (megatron's own gather allocates on the CUDA device, so it cannot run under gloo.)"""

    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


class _PaddingIdxEmbedding(torch.nn.Module):
    """Megatron's (vocab-parallel) token embedding with torch's `padding_idx` rule, as the HF model has it:
    lookups of the padding token give the weight no gradient (its row never trains)."""

    def __init__(self, embedding: torch.nn.Module, padding_idx: int | None):
        super().__init__()
        object.__setattr__(self, "inner", embedding)  # not a submodule: its weight is the GPTModel's
        self.padding_idx = padding_idx

    def forward(self, input_ids: Tensor) -> Tensor:
        out = self.inner(input_ids)
        if self.padding_idx is None:
            return out
        return torch.where((input_ids == self.padding_idx).unsqueeze(-1), out.detach(), out)


class MegatronCausalLM(torch.nn.Module):
    """GPTModel behind the HF call gymv's logprob functions make. Positions are those of a right-padded
    row (0..T-1), as the trainer's collate lays rows out, or a packed row's own (gymv.backends.packing); the
    KV-cache path is never taken (`gymv_lockstep`).
    `padding_idx`: the HF embedding's (its row gets no gradient there either)."""

    gymv_lockstep = True

    def __init__(self, gpt, shape: DecoderShape, hf_config: Any = None, padding_idx: int | None = None):
        super().__init__()
        self.gpt, self.shape, self.config, self.padding_idx = gpt, shape, hf_config, padding_idx

    def get_input_embeddings(self):
        return _PaddingIdxEmbedding(self.gpt.embedding.word_embeddings, self.padding_idx)

    def router_replica(self) -> RouterReplica:
        """How its routers share tokens (gymv.backends.moe_router): every TP rank routes all of them and the
        trainer sums the router's gradient over TP."""
        return RouterReplica(tensor=self.gpt.config.tensor_model_parallel_size)

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                inputs_embeds: Tensor | None = None, position_ids: Tensor | None = None, use_cache: bool = False,
                logits_to_keep: int | Tensor | None = None, **kwargs: Any) -> SimpleNamespace:
        """A padded batch (attention_mask [B, T]), or one packed row: [1, N] tokens with the keyword
        gymv.backends.packed_attention.KEYWORD (its segments), its positions (restarting per sequence, or
        3-D ones) and no attention mask. `logits_to_keep` as in HF models: logits [B, K, V] at those
        positions only."""
        ref = input_ids if input_ids is not None else inputs_embeds
        b, t = ref.shape[:2]
        packing = kwargs.get(packed_attention.KEYWORD)
        if packing is not None and (b != 1 or attention_mask is not None or position_ids is None):
            raise RuntimeError("a packed forward takes one row, its positions and no attention mask")
        if attention_mask is None and packing is None:
            attention_mask = torch.ones(b, t, dtype=torch.long, device=ref.device)
        rotary = contextlib.nullcontext()
        if getattr(self.shape, "mrope_section", None):  # 3-D positions [3, B, T], as the adapter computed them
            pos = position_ids if position_ids.dim() == 3 else position_ids[None].expand(3, b, t)
        else:  # megatron's rotary table counts 0..T-1 itself; a packed row's positions are its own
            pos = torch.arange(t, device=ref.device).expand(b, t)
            if packing is not None and getattr(self.gpt, "rotary_pos_emb", None) is not None:
                rotary = _rotary_at(self.gpt, position_ids.reshape(-1))
        if inputs_embeds is None:  # looked up here, with the padding rule, rather than inside GPTModel
            inputs_embeds = self.get_input_embeddings()(input_ids)
        decoder_input = inputs_embeds.transpose(0, 1).contiguous()
        mask = packing if packing is not None else megatron_mask(attention_mask)
        head = contextlib.nullcontext()
        if isinstance(logits_to_keep, Tensor) or (logits_to_keep or 0) > 0:
            head = _head_at(self.gpt, logits_to_keep)
        with rotary, head:
            logits = self.gpt(input_ids=input_ids, position_ids=pos, attention_mask=mask, decoder_input=decoder_input)
        if self.gpt.config.tensor_model_parallel_size > 1:
            from megatron.core import parallel_state

            logits = _GatherVocab.apply(logits, parallel_state.get_tensor_model_parallel_group())
        return SimpleNamespace(logits=logits)


class MegatronVLM(MegatronCausalLM):
    """A vision-language model whose language decoder is GPTModel: the HF model keeps its vision tower and
    projector (torch modules, trained too); its language model and head are dropped, the image features
    reach the decoder through `inputs_embeds` (GPTModel's decoder_input)."""

    def __init__(self, gpt, shape: DecoderShape, hf_config: Any, vision_model: torch.nn.Module,
                 padding_idx: int | None = None):
        super().__init__(gpt, shape, hf_config, padding_idx)
        self.vision_model = vision_model

    @property
    def device(self) -> torch.device:
        return next(self.gpt.parameters()).device

    def get_image_features(self, *args, **kwargs):
        return self.vision_model.get_image_features(*args, **kwargs)

    @property
    def model(self) -> torch.nn.Module:
        """The HF inner model (vision parts, and e.g. Qwen2-VL's get_rope_index for the adapter's positions)."""
        return getattr(self.vision_model, "model", self.vision_model)


def strip_language_model(hf_model: torch.nn.Module, shape: DecoderShape) -> torch.nn.Module:
    """The HF VLM without its language decoder and head (their weights live in the GPTModel twin)."""
    for path in (shape.hf_prefix.rstrip("."), shape.hf_head.rsplit(".", 1)[0]):
        parent_path, _, name = path.rpartition(".")
        parent = hf_model.get_submodule(parent_path) if parent_path else hf_model
        if isinstance(getattr(parent, name, None), torch.nn.Module):
            setattr(parent, name, torch.nn.Module())
    return hf_model
