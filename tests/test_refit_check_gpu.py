"""Refit checks on GPUs, between real Ray actors: the digests taken where the tensors live (the integer method),
over CUDA IPC on one GPU and NCCL between two; an engine that loads nothing, half or a wrong layout fails the
refit naming the tensors; the probe check passes a faithful bfloat16 refit; `gymv train` on one GPU checks its
refits and stops at the step whose refit did not load. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest

from gymv.errors import GymvError
from refit_faults import FAULTY, FAULTY_PROBED, faulty_cluster, one_step, set_fault
from train_helpers import ray_module, tiny_grpo_settings, write_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    with ray_module():
        yield


def _faults(cluster, model, transport: str) -> None:
    one_step(cluster)
    cluster.refit(1)
    for version, fault in [(2, "nothing"), (3, "half"), (4, "layout")]:
        set_fault(model, fault)
        one_step(cluster)
        with pytest.raises(GymvError, match=rf"step {version}'s refit over {transport}: generation worker 0 does not "
                                            r"hold the trainer's weights: \d+ of \d+ tensors differ"):
            cluster.refit(version)
    set_fault(model, "")
    cluster.refit(5)


@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
def test_gpu_refits_are_digest_checked_where_the_weights_are(faulty_model, transport):
    """CUDA IPC colocated on one GPU; NCCL from a training GPU to a generation GPU."""
    import torch

    gpus = 1 if transport == "cuda_ipc" else 2
    if torch.cuda.device_count() < gpus:
        pytest.skip("needs 2 GPUs")
    set_fault(faulty_model, "")
    cluster = faulty_cluster(faulty_model, transport, FAULTY, gpus=gpus)
    try:
        _faults(cluster, faulty_model, transport)
    finally:
        set_fault(faulty_model, "")
        cluster.shutdown()


def test_a_bfloat16_engine_passes_the_probe_and_an_unloaded_refit_fails_it(faulty_model):
    set_fault(faulty_model, "")
    cluster = faulty_cluster(faulty_model, "cuda_ipc", FAULTY_PROBED, gpus=1)
    try:
        one_step(cluster)
        cluster.refit(1)
        set_fault(faulty_model, "nothing")
        one_step(cluster)
        with pytest.raises(GymvError, match=r"step 2's refit over cuda_ipc: generation worker 0 scores the probe"):
            cluster.refit(2)
    finally:
        set_fault(faulty_model, "")
        cluster.shutdown()


def test_gymv_train_on_one_gpu_checks_its_refits(faulty_model, tmp_path):
    """Colocated on one GPU (static decoder, CUDA IPC): a run of the hf backend passes its checks; the faulty
    engine stops at the first step whose update moved a weight."""
    from gymv.train import train

    set_fault(faulty_model, "")
    gpu = {"cluster.gpus_per_node": 1, "cluster.colocated": True, "refit.transport": "cuda_ipc",
           "model.dtype": "bfloat16", "training.dtype": "bfloat16", "refit.check.first": 100}
    summary = train(write_recipe(tmp_path, "gpu-checked", "vlm_grpo.yaml", tiny_grpo_settings(tmp_path, faulty_model, **gpu)))
    assert summary["complete"]
    set_fault(faulty_model, "nothing")
    try:
        settings = tiny_grpo_settings(tmp_path, faulty_model, **gpu, **{"generation.backend": FAULTY})
        with pytest.raises(GymvError, match=r"step \d's refit over cuda_ipc: generation worker 0 does not hold"):
            train(write_recipe(tmp_path, "gpu-faulty", "vlm_grpo.yaml", settings))
    finally:
        set_fault(faulty_model, "")
