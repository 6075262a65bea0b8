"""Refit checks on GPUs, between real Ray actors: the digests taken where the tensors live (the integer method),
over CUDA IPC on one GPU and NCCL between two; an engine that loads nothing, half or a wrong layout fails the
refit naming the tensors; the probe check passes a faithful bfloat16 refit; `gymv train` on one GPU checks its
refits and stops at the step whose refit did not load. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import shutil

import pytest

from gymv.errors import GymvError
from tiny_models import tiny_path
from train_helpers import ray_module, tiny_grpo_settings, write_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_module():
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return shutil.copytree(tiny_path("tiny-llava"), tmp_path_factory.mktemp("faulty-gpu") / "model")


def set_fault(model, fault: str) -> None:
    from gymv_faulty_refits import fault_file

    fault_file(model).write_text(fault)


def _cluster(model, transport: str, backend: str, gpus: int = 1):
    from gymv.cluster.group import Placement, PolicyCluster
    from gymv.cluster.workers import WorkerSpec
    from gymv.config.schema import EnvSection, GenerationSection, RefitCheckSection, RefitSection, TrainingSection

    spec = WorkerSpec(model_path=str(model), env=EnvSection(name="circle_count"), generation_dtype="bfloat16",
                      device="cuda", generation=GenerationSection(backend=backend),
                      refit=RefitSection(transport=transport, check=RefitCheckSection(first=100)),
                      training=TrainingSection(backend="torch", dtype="bfloat16", lr=1e-3))
    return PolicyCluster(spec, Placement(num_generation=1, num_training=1, gpus=gpus, colocated=gpus == 1))


def _step(cluster) -> None:
    import random

    from gymv.algorithms.loss_fns import SFTLoss
    from gymv.envs.circle_count import TINY, CircleCount

    cluster.sft_step([(0, CircleCount().make_row(random.Random(0), TINY, 0), "row 0")], SFTLoss())


def _faults(cluster, model, transport: str) -> None:
    _step(cluster)
    cluster.refit(1)
    for version, fault in [(2, "nothing"), (3, "half"), (4, "layout")]:
        set_fault(model, fault)
        _step(cluster)
        with pytest.raises(GymvError, match=rf"step {version}'s refit over {transport}: generation worker 0 does not "
                                            r"hold the trainer's weights: \d+ of \d+ tensors differ"):
            cluster.refit(version)
    set_fault(model, "")
    cluster.refit(5)


def test_cuda_ipc_refits_are_digest_checked_on_the_gpu(model):
    set_fault(model, "")
    cluster = _cluster(model, "cuda_ipc", "faulty-refits")
    try:
        _faults(cluster, model, "cuda_ipc")
    finally:
        set_fault(model, "")
        cluster.shutdown()


def test_nccl_refits_are_digest_checked_on_the_gpu(model):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    set_fault(model, "")
    cluster = _cluster(model, "nccl", "faulty-refits", gpus=2)
    try:
        _faults(cluster, model, "nccl")
    finally:
        set_fault(model, "")
        cluster.shutdown()


def test_a_bfloat16_engine_passes_the_probe_and_an_unloaded_refit_fails_it(model):
    set_fault(model, "")
    cluster = _cluster(model, "cuda_ipc", "faulty-refits-probed")
    try:
        _step(cluster)
        cluster.refit(1)
        set_fault(model, "nothing")
        _step(cluster)
        with pytest.raises(GymvError, match=r"step 2's refit over cuda_ipc: generation worker 0 scores the probe"):
            cluster.refit(2)
    finally:
        set_fault(model, "")
        cluster.shutdown()


def test_gymv_train_on_one_gpu_checks_its_refits(model, tmp_path):
    """Colocated on one GPU (static decoder, CUDA IPC): a run of the hf backend passes its checks; the faulty
    engine stops at the first step whose update moved a weight."""
    from gymv.train import train

    set_fault(model, "")
    gpu = {"cluster.gpus_per_node": 1, "cluster.colocated": True, "refit.transport": "cuda_ipc",
           "model.dtype": "bfloat16", "training.dtype": "bfloat16", "refit.check.first": 100}
    summary = train(write_recipe(tmp_path, "gpu-checked", "vlm_grpo.yaml", tiny_grpo_settings(tmp_path, model, **gpu)))
    assert summary["complete"]
    set_fault(model, "nothing")
    try:
        settings = tiny_grpo_settings(tmp_path, model, **gpu, **{"generation.backend": "faulty-refits"})
        with pytest.raises(GymvError, match=r"step \d's refit over cuda_ipc: generation worker 0 does not hold"):
            train(write_recipe(tmp_path, "gpu-faulty", "vlm_grpo.yaml", settings))
    finally:
        set_fault(model, "")
