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

from dataclasses import dataclass

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


GENERATION_BACKENDS = Registry("generation backend", "gymv.generation_backends",
                               {"hf": "gymv.backends.generation.hf:HFGenerationBackend",
                                "vllm": "gymv.backends.generation.vllm:VllmGenerationBackend"}, where="generation.backend")
TRAINING_BACKENDS = Registry("training backend", "gymv.training_backends",
                             {"torch": "gymv.backends.training.hf_torch:HFTorchBackend",
                              "fsdp2": "gymv.backends.training.hf_fsdp:HFFSDPBackend",
                              "megatron": "gymv.backends.training.megatron:MegatronBackend"}, where="training.backend")
# a MOPD teacher's scorer, built from a gymv.cluster.teachers.TeacherSpec
TEACHER_BACKENDS = Registry("teacher backend", "gymv.teacher_backends",
                            {"torch": "gymv.backends.teacher:TeacherModel",
                             "vllm": "gymv.backends.teacher_vllm:VllmTeacher"}, where="mopd.teachers.*.backend")
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
