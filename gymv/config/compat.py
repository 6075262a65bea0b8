"""Cross-field rules that a per-key schema cannot express; shared by the loader (errors) and `gymv lint`.

Each rule is a function from a validated recipe to findings. Rules name the key to blame so the caller
can point at the file:line that wrote it. `RULES` is the registry; docs/config.md lists every rule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gymv.backends.registry import (
    AUTO_TRANSPORT,
    GENERATION_BACKENDS,
    REFIT_TRANSPORTS,
    TEACHER_BACKENDS,
    TRAINING_BACKENDS,
    TransportCapabilities,
)
from gymv.backends.generation.vllm_models import engine_keys
from gymv.findings import Finding
from gymv.config.schema import GrpoSection, MopdSection, RecipeBase
from gymv.config.tree import split_key
from gymv.yamlfile import KeyPath, Origin


@dataclass(frozen=True)
class Rule:
    id: str
    summary: str
    check: Callable[[RecipeBase], Iterator[Finding]]


RULES: list[Rule] = []


def rule(id: str, summary: str) -> Callable:
    """Register a check under a stable id (docs/config.md lists every id)."""
    def register(fn: Callable[[RecipeBase], Iterator[Finding]]) -> Callable[[RecipeBase], Iterator[Finding]]:
        RULES.append(Rule(id, summary, fn))
        return fn
    return register


def total_gpus(cfg: RecipeBase) -> int:
    return cfg.cluster.num_nodes * cfg.cluster.gpus_per_node


def training_gpus(cfg: RecipeBase) -> int:
    """GPUs the trainer uses: all of them when colocated, else `cluster.training_gpus`."""
    c = cfg.cluster
    if not c.colocated and c.training_gpus is not None:
        return c.training_gpus
    return total_gpus(cfg)


def generation_gpus(cfg: RecipeBase) -> int:
    c = cfg.cluster
    if not c.colocated and c.generation_gpus is not None:
        return c.generation_gpus
    return total_gpus(cfg)


def model_parallel_size(cfg: RecipeBase) -> int:
    p = cfg.training.parallel
    return p.tensor * p.pipeline * p.context


def data_parallel_size(cfg: RecipeBase) -> int:
    """Training ranks that each take a share of the batch: the training GPUs over the model-parallel size (1 on CPU)."""
    gpus = training_gpus(cfg)
    mp = model_parallel_size(cfg)
    return gpus // mp if gpus and gpus % mp == 0 else 1


def _grpo(cfg: RecipeBase) -> GrpoSection | None:
    s = cfg.algo_section
    return s if isinstance(s, GrpoSection) else None


def _mopd(cfg: RecipeBase) -> MopdSection | None:
    s = cfg.algo_section
    return s if isinstance(s, MopdSection) else None


def _async(cfg: RecipeBase) -> tuple[str, GrpoSection | MopdSection] | None:
    """(section name, section) of a GRPO or MOPD recipe whose generation runs asynchronously."""
    s = cfg.algo_section
    if isinstance(s, (GrpoSection, MopdSection)) and s.async_.enabled:
        return cfg.base_algorithm, s
    return None


def _err(rule_id: str, key: str, message: str, fix: str, severity: str = "error") -> Finding:
    return Finding(rule_id, message, key, None, fix, severity)  # type: ignore[arg-type]


# ---- refit -----------------------------------------------------------------------------------------------

def _transport(cfg: RecipeBase) -> tuple[str, TransportCapabilities | None]:
    """refit.transport and what its registry entry declares (None for auto, chosen at start)."""
    name = cfg.refit.transport
    return name, REFIT_TRANSPORTS.capabilities(name) if name != AUTO_TRANSPORT else None


@rule("refit.encoder-cache-reset", "reset_encoder_cache_after_weight_update needs a transport that implements the reset")
def _cache_reset(cfg: RecipeBase) -> Iterator[Finding]:
    name, t = _transport(cfg)  # auto picks among transports that all reset it
    if cfg.generation.reset_encoder_cache_after_weight_update and t is not None and not t.resets_encoder_cache:
        able = REFIT_TRANSPORTS.having(lambda c: c.resets_encoder_cache)
        yield _err("refit.encoder-cache-reset", "generation.reset_encoder_cache_after_weight_update",
                   f"refit transport {name!r} does not reset the vision encoder cache, so "
                   "reset_encoder_cache_after_weight_update would silently do nothing",
                   f"use refit.transport {' / '.join(able)}, or turn the flag off")


@rule("refit.transport-placement", "the refit transport must work with the cluster layout")
def _transport_layout(cfg: RecipeBase) -> Iterator[Finding]:
    name, t = _transport(cfg)
    if t is None:  # auto: chosen from the placement at start
        return
    if t.needs_gpu and total_gpus(cfg) == 0:
        yield _err("refit.transport-placement", "refit.transport", f"refit transport {name!r} needs GPUs, the cluster has none",
                   "use refit.transport: object_store on CPU")
    if t.colocated_only and not cfg.cluster.colocated:
        yield _err("refit.transport-placement", "refit.transport",
                   f"refit transport {name!r} needs training and generation on the same GPUs (cluster.colocated: false)",
                   "use refit.transport: nccl for separate GPUs")
    if t.single_node_only and cfg.cluster.num_nodes > 1:
        yield _err("refit.transport-placement", "refit.transport",
                   f"refit transport {name!r} works within one host, the cluster has {cfg.cluster.num_nodes} nodes",
                   "use refit.transport: nccl or object_store across nodes")


@rule("refit.transport-workers-per-gpu", "several generation workers on one GPU need a refit transport that allows it")
def _transport_workers_per_gpu(cfg: RecipeBase) -> Iterator[Finding]:
    (name, t), k = _transport(cfg), cfg.cluster.generation_workers_per_gpu
    if k > 1 and total_gpus(cfg) > 0 and t is not None and not t.shares_gpus:
        yield _err("refit.transport-workers-per-gpu", "cluster.generation_workers_per_gpu",
                   f"cluster.generation_workers_per_gpu is {k}, but refit transport {name!r} takes one receiver per GPU"
                   + (" (NCCL refuses two ranks on one device)" if name == "nccl" else ""),
                   "use refit.transport: object_store, or one generation worker per GPU")


# ---- async -----------------------------------------------------------------------------------------------

@rule("async.importance-sampling", "async GRPO and MOPD train on stale samples and must correct with importance sampling")
def _async_is(cfg: RecipeBase) -> Iterator[Finding]:
    a = _async(cfg)
    if a and a[1].importance_sampling.kind == "none":
        yield _err("async.importance-sampling", f"{a[0]}.importance_sampling.kind",
                   f"{a[0]}.async.enabled trains on off-policy samples but importance_sampling.kind is 'none'",
                   f"set {a[0]}.importance_sampling.kind: truncated (or icepop, seq_mask_tis)")


@rule("async.separate-gpus", "async GRPO and MOPD on GPUs need generation and training on separate GPUs")
def _async_gpus(cfg: RecipeBase) -> Iterator[Finding]:
    a = _async(cfg)
    if a and total_gpus(cfg) > 0 and cfg.cluster.colocated:
        yield _err("async.separate-gpus", "cluster.colocated",
                   f"{a[0]}.async.enabled runs generation while training, which needs cluster.colocated: false on GPUs",
                   "set cluster.colocated: false with cluster.generation_gpus and cluster.training_gpus")


@rule("async.in-flight-encoder-cache", "in-flight weight updates cannot honour an encoder-cache reset")
def _async_in_flight(cfg: RecipeBase) -> Iterator[Finding]:
    a = _async(cfg)
    if a and a[1].async_.in_flight_weight_updates and cfg.generation.reset_encoder_cache_after_weight_update:
        yield _err("async.in-flight-encoder-cache", f"{a[0]}.async.in_flight_weight_updates",
                   "in-flight weight updates land in the middle of a rollout, whose later turns would mix image features "
                   "of two weight versions, so they cannot be combined with reset_encoder_cache_after_weight_update",
                   f"set {a[0]}.async.in_flight_weight_updates: false (updates then land between rollouts)")


@rule("async.refit-transport", "async GRPO and MOPD need a refit transport that a lagging generator can read safely")
def _async_transport(cfg: RecipeBase) -> Iterator[Finding]:
    a = _async(cfg)
    name, t = _transport(cfg)
    if a and t is not None and not t.lag_safe:
        able = REFIT_TRANSPORTS.having(lambda c: c.lag_safe)
        yield _err("async.refit-transport", "refit.transport",
                   f"refit transport {name!r} reuses one buffer, which the next publish overwrites while a generator "
                   "that is still busy with a rollout has not read it yet",
                   f"use refit.transport {' / '.join(able)} with {a[0]}.async.enabled")


# ---- GPUs and parallelism --------------------------------------------------------------------------------

@rule("cluster.gpu-split", "generation_gpus/training_gpus are set exactly when not colocated, and fit the cluster")
def _gpu_split(cfg: RecipeBase) -> Iterator[Finding]:
    c, total = cfg.cluster, total_gpus(cfg)
    if c.colocated:
        for k in ("generation_gpus", "training_gpus"):
            if getattr(c, k) is not None:
                yield _err("cluster.gpu-split", f"cluster.{k}", f"cluster.{k} is set but cluster.colocated is true "
                           "(colocated generation and training share every GPU)", f"remove cluster.{k} or set cluster.colocated: false")
        return
    if total == 0:
        return
    for k in ("generation_gpus", "training_gpus"):
        if not getattr(c, k):
            yield _err("cluster.gpu-split", f"cluster.{k}", f"cluster.colocated is false but cluster.{k} is not set",
                       f"set cluster.{k} (GPUs out of {total})")
    if not (c.generation_gpus and c.training_gpus):
        return
    m = _mopd(cfg)
    teacher = sum(t.gpus or 0 for t in m.teachers.values() if t.placement == "separate") if m else 0
    used = c.generation_gpus + c.training_gpus + teacher
    parts = f"generation {c.generation_gpus} + training {c.training_gpus}" + (f" + teachers {teacher}" if teacher else "")
    if used > total:
        yield _err("cluster.gpu-split", "cluster.generation_gpus", f"{parts} = {used} GPUs, the cluster has {total}",
                   "lower the split or add nodes")
    elif used < total:
        yield _err("cluster.gpu-split", "cluster.generation_gpus", f"{parts} = {used} GPUs, {total - used} of {total} stay idle",
                   "give the idle GPUs to generation or training", "warning")


@rule("cluster.placement-colocated", "colocated on GPUs, generation shares the training bundles and their placement")
def _placement_colocated(cfg: RecipeBase) -> Iterator[Finding]:
    c = cfg.cluster
    if c.colocated and total_gpus(cfg) > 0 and c.placement.generation != type(c.placement.generation)():
        yield _err("cluster.placement-colocated", "cluster.placement.generation",
                   "cluster.placement.generation is set, but colocated generation workers sit in the training ranks' "
                   "bundles, which cluster.placement.training places", "move the settings to cluster.placement.training, "
                   "or set cluster.colocated: false")


@rule("parallel.divides-gpus", "tensor*pipeline*context, and expert (each expert whole, megatron's expert tensor "
                               "parallel size 1), must each divide the training GPUs (on a CPU, the training ranks)")
def _parallel_divides(cfg: RecipeBase) -> Iterator[Finding]:
    mp = model_parallel_size(cfg)
    ranks, key = training_ranks(cfg)
    p = cfg.training.parallel
    what = f"{ranks} training GPUs" if total_gpus(cfg) else f"{ranks} training ranks ({key})"
    if ranks % mp:
        yield _err("parallel.divides-gpus", "training.parallel",
                   f"tensor {p.tensor} x pipeline {p.pipeline} x context {p.context} = {mp} does not divide the {what}",
                   "choose sizes whose product divides the rank count (data parallel takes the rest)")
    if ranks % p.expert:
        # the EP group folds over tensor, context and data ranks alike (expert tensor parallel size 1)
        yield _err("parallel.divides-gpus", "training.parallel.expert",
                   f"expert {p.expert} does not divide the {what}",
                   "choose an expert parallel size that divides the rank count")


@rule("parallel.backend", "model parallelism needs a training backend that declares it (megatron; on GPUs or, over "
                          "gloo, on a CPU)")
def _parallel_backend(cfg: RecipeBase) -> Iterator[Finding]:
    p = cfg.training.parallel
    used = [k for k in ("tensor", "pipeline", "context", "expert") if getattr(p, k) > 1]
    if not used:
        return
    backend = cfg.training.backend
    if not TRAINING_BACKENDS.capabilities(backend).model_parallel:
        able = " or ".join(TRAINING_BACKENDS.having(lambda c: c.model_parallel))
        yield _err("parallel.backend", f"training.parallel.{used[0]}",
                   f"training.parallel.{used[0]} > 1 needs training.backend: {able} ({backend} has no model parallelism)",
                   f"set training.backend: {able} or the parallel sizes to 1")


def training_ranks(cfg: RecipeBase) -> tuple[int, str]:
    """How many training ranks the run starts, and the recipe key that sets that number."""
    c = cfg.cluster
    if total_gpus(cfg) == 0:
        return c.cpu_training_ranks, "cluster.cpu_training_ranks"
    if not c.colocated and c.training_gpus is not None:
        return c.training_gpus, "cluster.training_gpus"
    return total_gpus(cfg), "cluster.gpus_per_node" if c.gpus_per_node > 1 else "cluster.num_nodes"


@rule("training.one-rank", "a training backend that declares one rank (torch) gets one training rank")
def _one_rank(cfg: RecipeBase) -> Iterator[Finding]:
    ranks, key = training_ranks(cfg)
    backend = cfg.training.backend
    if ranks > 1 and TRAINING_BACKENDS.capabilities(backend).one_rank:
        able = " or ".join(n for n, c in TRAINING_BACKENDS.declared().items() if not c.one_rank)
        yield _err("training.one-rank", key, f"training.backend {backend} trains on one rank, {key} gives it {ranks}",
                   f"set training.backend: {able} (fsdp2 shards the same trainer over the ranks), or train on one rank")


@rule("training.compile-backend", "training.compile needs a training backend that declares it compiles (torch, fsdp2)")
def _compile_backend(cfg: RecipeBase) -> Iterator[Finding]:
    t = cfg.training
    if t.compile and not TRAINING_BACKENDS.capabilities(t.backend).compiles:
        able = " or ".join(TRAINING_BACKENDS.having(lambda c: c.compiles))
        yield _err("training.compile-backend", "training.compile",
                   f"training.compile is not wired for training.backend {t.backend}",
                   f"set training.compile: false, or training.backend: {able}")


@rule("teacher.parallel", "a teacher's tensor and expert parallel sizes fit its backend, placement and GPUs")
def _teacher_parallel(cfg: RecipeBase) -> Iterator[Finding]:
    m = _mopd(cfg)
    for alias, t in (m.teachers.items() if m else ()):
        key = f"mopd.teachers.{alias}"
        tp, ep = t.tensor_parallel_size, t.expert_parallel_size
        one_device = t.backend in TEACHER_BACKENDS and not TEACHER_BACKENDS.capabilities(t.backend).spans_gpus
        if (tp > 1 or ep > 1) and one_device:
            able = " or ".join(TEACHER_BACKENDS.having(lambda c: c.spans_gpus))
            yield _err("teacher.parallel", f"{key}.tensor_parallel_size" if tp > 1 else f"{key}.expert_parallel_size",
                       f"teacher {alias!r} uses backend {t.backend}, whose replicas run on one device each",
                       f"use backend: {able} for a teacher split over GPUs, or sizes of 1")
        ranks = t.backend in TEACHER_BACKENDS and TEACHER_BACKENDS.capabilities(t.backend).rank_per_device
        if ep > 1 and ranks and tp % ep:  # megatron: EP groups are blocks of the replica's TP ranks
            yield _err("teacher.parallel", f"{key}.expert_parallel_size",
                       f"teacher {alias!r}: expert_parallel_size {ep} does not divide tensor_parallel_size {tp} (a "
                       f"replica's experts are split over blocks of its {tp} ranks)",
                       f"use a divisor of {tp} ({tp}: the experts split over all the replica's GPUs, or 1)")
        elif ep > 1 and not ranks and ep != tp:  # an engine (vllm) splits them over all of its GPUs
            yield _err("teacher.parallel", f"{key}.expert_parallel_size",
                       f"teacher {alias!r}: expert_parallel_size {ep} differs from tensor_parallel_size {tp} (a "
                       "replica's experts are split over the GPUs it spans)",
                       f"set expert_parallel_size to {tp} (experts split over the replica's GPUs) or 1")
        if tp > 1 and t.placement == "colocated":
            yield _err("teacher.parallel", f"{key}.tensor_parallel_size",
                       f"teacher {alias!r} spans {tp} GPUs per replica but is colocated (a share of one policy GPU)",
                       "use placement: separate with gpus = data_parallel_size x tensor_parallel_size")
        elif tp > 1 and t.placement == "separate" and t.gpus is not None and t.gpus != t.data_parallel_size * tp:
            yield _err("teacher.parallel", f"{key}.gpus",
                       f"teacher {alias!r}: gpus {t.gpus} is not data_parallel_size {t.data_parallel_size} x "
                       f"tensor_parallel_size {tp}", f"set gpus: {t.data_parallel_size * tp}")


@rule("generation.decode-backend", "generation.decode static needs a generation backend that declares a decoder")
def _decode_backend(cfg: RecipeBase) -> Iterator[Finding]:
    g = cfg.generation
    if g.decode == "static" and not GENERATION_BACKENDS.capabilities(g.backend).decoder:
        able = " or ".join(GENERATION_BACKENDS.having(lambda c: c.decoder))
        yield _err("generation.decode-backend", "generation.decode",
                   f"generation.decode static needs generation.backend {able}, this recipe uses {g.backend} (which "
                   "decodes its own way)", "use generation.decode: auto with this backend")


@rule("vllm.engine-kwargs", "engine_kwargs may not set a vLLM engine argument gymv sets itself")
def _engine_kwargs(cfg: RecipeBase) -> Iterator[Finding]:
    mopd = getattr(cfg, "mopd", None)
    sections = [("generation.vllm", cfg.generation.vllm.engine_kwargs)] + [
        (f"mopd.teachers.{alias}", t.engine_kwargs) for alias, t in (mopd.teachers.items() if mopd else ())]
    for section, kwargs in sections:
        owned = engine_keys(section)
        for key in kwargs:
            if key in owned:
                gymv_key, what = owned[key]
                yield _err("vllm.engine-kwargs", f"{section}.engine_kwargs.{key}",
                           f"{section}.engine_kwargs.{key}: gymv sets vLLM's {key} itself ({what}"
                           + (f", from {gymv_key})" if gymv_key else ")"),
                           f"set {gymv_key} instead" if gymv_key else f"remove {key}: gymv decides it")


@rule("vllm.tensor-parallel", "vllm.tensor_parallel_size must divide the generation GPUs")
def _vllm_tp(cfg: RecipeBase) -> Iterator[Finding]:
    gpus, tp = generation_gpus(cfg), cfg.generation.vllm.tensor_parallel_size
    if GENERATION_BACKENDS.capabilities(cfg.generation.backend).reads_vllm_section and gpus > 0 and gpus % tp:
        yield _err("vllm.tensor-parallel", "generation.vllm.tensor_parallel_size",
                   f"generation.vllm.tensor_parallel_size {tp} does not divide the {gpus} generation GPUs",
                   "pick a size that divides the generation GPUs")


# ---- batches ---------------------------------------------------------------------------------------------

@rule("batch.divides-step", "the samples of one step must split into whole optimizer batches")
def _batch_divides(cfg: RecipeBase) -> Iterator[Finding]:
    n, gbs = cfg.samples_per_step, cfg.training.global_batch_size or cfg.samples_per_step
    if n % gbs:
        yield _err("batch.divides-step", "training.global_batch_size",
                   f"training.global_batch_size {gbs} does not divide the {n} samples of one step",
                   "use a divisor of the samples per step (prompts_per_step x generations_per_prompt, or sft.batch_size)")


@rule("batch.data-parallel", "the global batch must split evenly across data-parallel ranks")
def _batch_dp(cfg: RecipeBase) -> Iterator[Finding]:
    dp, gbs = data_parallel_size(cfg), cfg.training.global_batch_size or cfg.samples_per_step
    if gbs % dp:
        yield _err("batch.data-parallel", "training.global_batch_size",
                   f"training.global_batch_size {gbs} does not split across {dp} data-parallel ranks",
                   f"use a multiple of {dp}")


@rule("rollout.fits-context", "a rollout must fit the model's context")
def _fits(cfg: RecipeBase) -> Iterator[Finding]:
    if cfg.env.max_rollout_tokens > cfg.model.max_seq_len:
        yield _err("rollout.fits-context", "env.max_rollout_tokens",
                   f"env.max_rollout_tokens {cfg.env.max_rollout_tokens} exceeds model.max_seq_len {cfg.model.max_seq_len}",
                   "lower env.max_rollout_tokens or raise model.max_seq_len")


@rule("data.source", "training data comes from data.train or data.prepare")
def _data_source(cfg: RecipeBase) -> Iterator[Finding]:
    if cfg.data.train is None and cfg.data.prepare is None:
        yield _err("data.source", "data.train", "no training data: data.train and data.prepare are both null",
                   "set data.train to a JSONL file, or data.prepare to generate one")


# ---- GRPO ------------------------------------------------------------------------------------------------

@rule("grpo.leave-one-out", "a leave-one-out baseline needs at least two generations per prompt")
def _loo(cfg: RecipeBase) -> Iterator[Finding]:
    g = _grpo(cfg)
    if g and g.advantage.baseline == "leave_one_out" and g.generations_per_prompt < 2:
        yield _err("grpo.leave-one-out", "grpo.generations_per_prompt",
                   "grpo.advantage.baseline leave_one_out needs grpo.generations_per_prompt >= 2",
                   "raise generations_per_prompt, or use baseline: mean")


@rule("grpo.greedy", "greedy sampling makes every generation of a prompt the same, so advantages vanish")
def _greedy(cfg: RecipeBase) -> Iterator[Finding]:
    g = _grpo(cfg)
    if g and cfg.generation.temperature == 0 and g.generations_per_prompt > 1:
        yield _err("grpo.greedy", "generation.temperature",
                   "generation.temperature 0 gives identical generations per prompt: every advantage is 0",
                   "sample with temperature > 0", "warning")


# ---- MOPD ------------------------------------------------------------------------------------------------

@rule("mopd.routing", "every agent routes to a defined teacher")
def _routing(cfg: RecipeBase) -> Iterator[Finding]:
    m = _mopd(cfg)
    if not m:
        return
    for agent, alias in m.agent_to_teacher.items():
        if alias not in m.teachers:
            yield _err("mopd.routing", f"mopd.agent_to_teacher.{agent}",
                       f"agent {agent!r} routes to teacher {alias!r}, which is not in mopd.teachers",
                       f"use one of: {', '.join(m.teachers)}")
    if m.default_teacher_alias is not None and m.default_teacher_alias not in m.teachers:
        yield _err("mopd.routing", "mopd.default_teacher_alias",
                   f"mopd.default_teacher_alias {m.default_teacher_alias!r} is not in mopd.teachers",
                   f"use one of: {', '.join(m.teachers)}")
    if m.strict_agent_name_match and m.default_teacher_alias is not None:
        yield _err("mopd.routing", "mopd.default_teacher_alias",
                   f"mopd.default_teacher_alias {m.default_teacher_alias!r} is never used: "
                   "mopd.strict_agent_name_match is true, so an unmatched agent is an error",
                   "set mopd.strict_agent_name_match: false to route unmatched agents to the default teacher, "
                   "or remove mopd.default_teacher_alias")
    if not m.strict_agent_name_match and m.default_teacher_alias is None:
        yield _err("mopd.routing", "mopd.strict_agent_name_match",
                   "mopd.strict_agent_name_match is false but no default_teacher_alias catches unmatched agents",
                   "set mopd.default_teacher_alias, or strict_agent_name_match: true")


@rule("mopd.teacher-gpus", "a separately placed teacher on GPUs says how many GPUs it gets")
def _teacher_gpus(cfg: RecipeBase) -> Iterator[Finding]:
    m = _mopd(cfg)
    for alias, t in (m.teachers.items() if m else ()):
        key = f"mopd.teachers.{alias}.gpus"
        if t.placement == "colocated" and t.gpus is not None:
            yield _err("mopd.teacher-gpus", key, f"teacher {alias!r} is colocated, so `gpus` has no effect",
                       "remove gpus, or set placement: separate")
        elif t.placement == "separate" and total_gpus(cfg) > 0:
            if not t.gpus:
                yield _err("mopd.teacher-gpus", key, f"teacher {alias!r} is placed separately but has no gpus",
                           f"set {key}")
            elif t.gpus % t.data_parallel_size:
                yield _err("mopd.teacher-gpus", key,
                           f"teacher {alias!r}: data_parallel_size {t.data_parallel_size} does not divide its {t.gpus} GPUs",
                           "use a data_parallel_size that divides gpus")


# ---- entry point -----------------------------------------------------------------------------------------

def check_compatibility(cfg: RecipeBase, locate: Callable[[KeyPath], Origin | str | None] | None = None) -> list[Finding]:
    """Every cross-field finding for a validated recipe; `locate(path)` adds file:line to each."""
    out = []
    data = cfg.to_dict()
    for r in RULES:
        for f in r.check(cfg):
            if locate is not None and f.key:
                path = split_key(data, f.key) or tuple(f.key.split("."))
                where = locate(path)
                f = f.located(str(where) if where else None)
            out.append(f)
    return out
