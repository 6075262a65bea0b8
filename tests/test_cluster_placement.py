"""Placement.from_config: how many generation and training workers a cluster section asks for."""

from __future__ import annotations

from gymv.cluster.group import Placement
from gymv.config.schema import MODELS


def cfg(**cluster):
    return MODELS["grpo"].model_validate({"algorithm": "grpo", "cluster": cluster})


def test_a_cpu_run_has_one_generation_worker_by_default():
    p = Placement.from_config(cfg())
    assert (p.num_generation, p.num_training, p.gpus) == (1, 1, 0)


def test_on_a_cpu_generation_workers_per_gpu_is_the_number_of_generation_workers():
    assert Placement.from_config(cfg(generation_workers_per_gpu=3)).num_generation == 3


def test_separate_gpus_get_that_many_generation_workers_per_generation_gpu():
    p = Placement.from_config(cfg(gpus_per_node=4, colocated=False, generation_gpus=1, training_gpus=3,
                                  generation_workers_per_gpu=3))
    assert (p.num_generation, p.num_training, p.generation_per_gpu, p.colocated) == (3, 3, 3, False)


def test_colocated_gpus_get_that_many_generation_workers_on_every_gpu():
    p = Placement.from_config(cfg(gpus_per_node=2, generation_workers_per_gpu=2))
    assert (p.num_generation, p.num_training, p.colocated) == (4, 2, True)
