"""The registries of the engine's extension points: generation backends, training backends and refit
transports (name -> class; built-ins here, others by `register` or by entry point). A concrete backend is
named in exactly one place: its entry below. A plugin distribution declares, e.g.::

    [project.entry-points."gymv.generation_backends"]
    my-engine = "my_package.engine:MyGenerationBackend"
"""

from __future__ import annotations

from gymv.registry import Registry

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
    "object_store": "gymv.cluster.refit:ObjectStoreSender",
    "shm": "gymv.cluster.refit:ShmSender",
    "cuda_ipc": "gymv.cluster.refit:CudaIpcSender",
    "nccl": "gymv.cluster.refit:NcclSender",
    "collective": "gymv.cluster.refit:CollectiveSender",
}, where="refit.transport")
