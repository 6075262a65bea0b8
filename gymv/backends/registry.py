"""The registries of the engine's extension points: generation backends, training backends and refit
transports (name -> class; built-ins here, others by `register` or by entry point). A concrete backend is
named in exactly one place: its entry below, together with what it can do (its capabilities), which
`gymv lint`, `gymv train`'s pre-flight and `gymv smoke --tiny` read without importing it. A plugin
distribution declares, e.g.::

    [project.entry-points."gymv.generation_backends"]
    my-engine = "my_package.engine:MyGenerationBackend"

and its class may carry a `capabilities` attribute (else the registry's defaults apply).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field

from gymv.registry import Registry

AUTO_TRANSPORT = "auto"  # refit.transport: chosen at start from where the workers are (gymv.cluster.transport_choice)


@dataclass(frozen=True)
class TransportCapabilities:
    """What a refit transport can do; compatibility rules read these instead of naming transports. The
    defaults (an undeclared plugin) promise nothing that a wrong guess would turn into silent harm."""

    resets_encoder_cache: bool = False  # clears the vision encoder's feature cache after a successful refit
    needs_gpu: bool = False
    colocated_only: bool = False  # both sides must share the GPUs (e.g. CUDA IPC handles)
    single_node_only: bool = False  # both sides must share a host (e.g. shared memory)
    # A generator that lags behind still reads whole weights: each publish is its own object, or the sender
    # waits for the receivers. A buffer that the next publish overwrites is not (async GRPO needs this).
    lag_safe: bool = False
    shares_gpus: bool = True  # several receivers may sit on one GPU (cluster.generation_workers_per_gpu > 1)


@dataclass(frozen=True)
class Package:
    """An optional distribution a backend needs: its pip name, a module that imports once it is installed, and
    how to get it (the fix `gymv train` prints before anything starts)."""

    name: str
    module: str
    fix: str

    def installed(self) -> bool:
        """`module` is found here (looked up, not imported; a bare folder of that name is not the package)."""
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):  # its parent package lacks it
            return False
        return spec is not None and spec.origin not in (None, "namespace")


@dataclass(frozen=True)
class BackendCapabilities:
    """What a generation, training or teacher backend can run. The defaults suit a plugin that declares nothing:
    no optional package, no model parallelism, no training.compile, every model family."""

    needs: Package | None = None
    # takes generation.vllm: its create() gets the section itself (`vllm=`) and `full_logits=`; the section's
    # tensor_parallel_size spans GPUs per engine
    reads_vllm_section: bool = False
    model_parallel: tuple[str, ...] = ()  # training.parallel sizes (tensor, pipeline, context, expert) it runs > 1
    spans_gpus: bool = False  # a teacher replica may span GPUs (mopd.teachers.*.tensor_parallel_size > 1)
    # a teacher replica spanning N devices is N ranks (one process each, one process group: megatron), not one
    # process driving them all (vllm); on a CPU too, where its ranks talk over gloo
    rank_per_device: bool = False
    reads_engine_kwargs: bool = False  # a teacher that takes mopd.teachers.*.engine_kwargs (vLLM engine arguments)
    compiles: bool = False  # training.compile compiles its decoder layers
    one_rank: bool = False  # trains on one rank only (a recipe that gives it more is refused)
    refused_families: Mapping[str, str] = field(default_factory=dict)  # model type (config.json) -> why not
    # "module:function(engine, decode, *, seed, max_batch)" that puts a built engine in the decode loop
    # generation.decode asks for (hf's static decoder); None: the engine decodes its own way (auto, eager)
    decoder: str | None = None
    # "module:function(path, device, dtype, *, text_only) -> (why, fix) | None": the checkpoints it cannot run
    # there, judged from their config.json by `gymv train` before Ray starts (vLLM's: VLLM_FAMILY_LIMITS)
    model_check: str | None = None
    # how a generation engine proves it holds a refit's weights (gymv.cluster.refit_check): "digest" (it
    # fingerprints its weights in checkpoint names), "probe" (it scores a fixed sequence), None: it cannot
    refit_check: str | None = None


VLLM_VENV_FIX = ("install vLLM's venv with `bash scripts/install.sh vllm` and run gymv from it "
                 "(\"$(bash scripts/install_vllm.sh --path)/bin/gymv\")")
VLLM_MODEL_CHECK = "gymv.backends.generation.vllm_models:refusal"
MEGATRON = Package("megatron-core", "megatron.core",
                   "pip install 'gymv[megatron]' (megatron-core 0.16.1 on Python 3.11, 0.19.2 on 3.12+; on a GPU "
                   "machine pip install --no-deps megatron-core keeps the installed torch)")

GENERATION_BACKENDS = Registry("generation backend", "gymv.generation_backends", {
    "hf": ("gymv.backends.generation.hf:HFGenerationBackend",
           BackendCapabilities(decoder="gymv.backends.generation.static:with_decode", refit_check="digest")),
    "vllm": ("gymv.backends.generation.vllm:VllmGenerationBackend", BackendCapabilities(
        needs=Package("vllm", "vllm", VLLM_VENV_FIX + ", or use generation.backend: hf"), reads_vllm_section=True,
        model_check=VLLM_MODEL_CHECK, refit_check="probe")),
}, where="generation.backend", default=BackendCapabilities())
TRAINING_BACKENDS = Registry("training backend", "gymv.training_backends", {
    "torch": ("gymv.backends.training.hf_torch:HFTorchBackend", BackendCapabilities(compiles=True, one_rank=True)),
    "fsdp2": ("gymv.backends.training.hf_fsdp:HFFSDPBackend", BackendCapabilities(compiles=True)),
    "megatron": ("gymv.backends.training.megatron:MegatronBackend", BackendCapabilities(
        needs=MEGATRON, model_parallel=("tensor", "context", "expert"))),  # context, expert: Nemotron-H's hybrid model
}, where="training.backend", default=BackendCapabilities())
# a MOPD teacher's scorer, built from a gymv.backends.teacher_spec.TeacherSpec
TEACHER_BACKENDS = Registry("teacher backend", "gymv.teacher_backends", {
    "torch": "gymv.backends.teacher:TeacherModel",
    "vllm": ("gymv.backends.teacher_vllm:VllmTeacher", BackendCapabilities(
        needs=Package("vllm", "vllm", VLLM_VENV_FIX + ", or use backend: torch"), spans_gpus=True,
        model_parallel=("tensor", "expert"), reads_engine_kwargs=True, model_check=VLLM_MODEL_CHECK)),
    # the megatron training backend's twin, scoring only; its model parallelism is the trainer's (tensor, and
    # expert for Nemotron-H's hybrid model, folded over a replica's TP ranks)
    "megatron": ("gymv.backends.teacher_megatron:MegatronTeacher", BackendCapabilities(
        needs=MEGATRON, spans_gpus=True, rank_per_device=True, model_parallel=("tensor", "expert"),
        refused_families=TRAINING_BACKENDS.capabilities("megatron").refused_families)),
}, where="mopd.teachers.*.backend", default=BackendCapabilities())
# a transport's entry is its sender class; the sender names its receiver class (`receiver`)
REFIT_TRANSPORTS = Registry("refit transport", "gymv.refit_transports", {
    # through the Ray object store: works anywhere, CPU included
    "object_store": ("gymv.cluster.refit:ObjectStoreSender",
                     TransportCapabilities(resets_encoder_cache=True, lag_safe=True)),
    # POSIX shared memory between the processes of one host
    "shm": ("gymv.cluster.refit:ShmSender", TransportCapabilities(resets_encoder_cache=True, single_node_only=True)),
    # CUDA IPC handles: zero-copy when training and generation share the GPUs
    "cuda_ipc": ("gymv.cluster.refit:CudaIpcSender", TransportCapabilities(
        resets_encoder_cache=True, needs_gpu=True, colocated_only=True, shares_gpus=False)),
    # NCCL broadcast from the trainer ranks to the generation workers
    "nccl": ("gymv.cluster.refit:NcclSender", TransportCapabilities(
        resets_encoder_cache=True, needs_gpu=True, lag_safe=True, shares_gpus=False)),
    # broadcast over a gloo process group of its own (the nccl transport on CPUs)
    "collective": ("gymv.cluster.refit:CollectiveSender",
                   TransportCapabilities(resets_encoder_cache=True, lag_safe=True)),
}, where="refit.transport", default=TransportCapabilities())
