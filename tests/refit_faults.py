"""Shared pieces of the refit-check tests: a policy cluster of the tiny LLaVA whose engines are the faulty-refit
plugin backends (tests/train_plugin/gymv_faulty_refits.py), the fault they load with, and one optimizer step
that moves the weights before a refit."""

from __future__ import annotations

FAULTY = "faulty-refits"  # tests/train_plugin: entry points of the gymv.generation_backends group
FAULTY_PROBED = "faulty-refits-probed"


def set_fault(model, fault: str) -> None:
    from gymv_faulty_refits import set_fault as set_  # the plugin folder is on the path while Ray is up

    set_(model, fault)


def faulty_cluster(model, transport: str, backend: str = FAULTY, *, gpus: int = 0):
    """One generation worker and one training rank, every refit checked; on `gpus` GPUs (0: the CPU)."""
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, GenerationSection, RefitCheckSection, RefitSection, TrainingSection

    spec = WorkerSpec(model_path=str(model), env=EnvSection(name="circle_count"), generation_dtype="bfloat16",
                      device="cuda" if gpus else "cpu", generation=GenerationSection(backend=backend),
                      refit=RefitSection(transport=transport, check=RefitCheckSection(first=100)),
                      training=TrainingSection(backend="torch", dtype="bfloat16" if gpus else "float32", lr=1e-3))
    return PolicyCluster(spec, Placement(num_generation=1, num_training=1, gpus=gpus, colocated=gpus <= 1))


def one_step(cluster) -> None:
    """One SFT optimizer step, so that the next refit sends weights the engine does not hold yet."""
    import random

    from gymv.algorithms.loss_fns import SFTLoss
    from gymv.envs.circle_count import TINY, CircleCount

    cluster.sft_step([(0, CircleCount().make_row(random.Random(0), TINY, 0), "row 0")], SFTLoss())
