"""Placement.from_config: how many generation and training workers a cluster section asks for."""

from __future__ import annotations

from gymv.cluster.group import Placement
from gymv.config.schema import MODELS


def cfg(**cluster):
    return MODELS["grpo"].model_validate({"algorithm": "grpo", "cluster": cluster})


def test_a_cpu_run_has_one_generation_worker_by_default():
    p = Placement.from_config(cfg())
    assert (p.num_generation, p.num_training, p.gpus) == (1, 1, 0)


def test_a_cpu_run_takes_its_training_ranks_from_cpu_training_ranks_spread_over_its_nodes():
    p = Placement.from_config(cfg(cpu_training_ranks=2, num_nodes=2))
    assert (p.num_training, p.nodes, p.gpus) == (2, 2, 0)
    assert Placement.from_config(cfg(num_nodes=2)).nodes == 1  # one rank: nothing to spread


def test_on_a_cpu_generation_workers_per_gpu_is_the_number_of_generation_workers():
    assert Placement.from_config(cfg(generation_workers_per_gpu=3)).num_generation == 3


def test_separate_gpus_get_that_many_generation_workers_per_generation_gpu():
    p = Placement.from_config(cfg(gpus_per_node=4, colocated=False, generation_gpus=1, training_gpus=3,
                                  generation_workers_per_gpu=3))
    assert (p.num_generation, p.num_training, p.generation_per_gpu, p.colocated) == (3, 3, 3, False)


def test_colocated_gpus_get_that_many_generation_workers_on_every_gpu():
    p = Placement.from_config(cfg(gpus_per_node=2, generation_workers_per_gpu=2))
    assert (p.num_generation, p.num_training, p.colocated) == (4, 2, True)


def test_a_tensor_parallel_engine_spans_that_many_gpus_and_engines_do_not_overlap():
    from gymv.cluster.placement import Placement

    p = Placement(num_generation=2, num_training=4, gpus=8, colocated=False, generation_tp=2)
    assert [p.engine_gpus(e) for e in range(2)] == [[0, 1], [2, 3]]
    assert p.generation_gpus == 4
    assert [p.rank_gpu(r) for r in range(4)] == [4, 5, 6, 7]


def test_engines_sharing_a_gpu_sit_on_the_same_one():
    from gymv.cluster.placement import Placement

    p = Placement(num_generation=4, num_training=2, gpus=2, colocated=True, generation_per_gpu=2)
    assert [p.engine_gpus(e) for e in range(4)] == [[0], [0], [1], [1]]
    assert [p.rank_gpu(r) for r in range(2)] == [0, 1]


def test_vllm_tensor_parallel_size_makes_fewer_wider_engines():
    c = MODELS["grpo"].model_validate({"algorithm": "grpo", "cluster": {"gpus_per_node": 8, "colocated": False,
                                                                        "generation_gpus": 4, "training_gpus": 4},
                                       "generation": {"backend": "vllm", "vllm": {"tensor_parallel_size": 2}}})
    p = Placement.from_config(c)
    assert (p.num_generation, p.generation_tp, p.engine_gpus(1)) == (2, 2, [2, 3])


def test_a_trainer_mesh_lays_ranks_out_tensor_fastest_and_groups_data_replicas():
    from gymv.cluster.placement import TrainerMesh

    m = TrainerMesh(tensor=2, pipeline=2, data=2)
    assert m.size == 8
    assert [m.coords(r) for r in (0, 1, 2, 3, 4, 7)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert m.data_group(3) == [3, 7]
    assert [r for r in range(8) if m.publishes(r)] == [0, 1, 2, 3]


def test_training_parallel_sizes_give_the_placement_its_mesh():
    c = MODELS["grpo"].model_validate({"algorithm": "grpo", "cluster": {"gpus_per_node": 8},
                                       "training": {"backend": "megatron", "parallel": {"tensor": 2, "pipeline": 2}}})
    p = Placement.from_config(c)
    assert p.num_training == 8 and (p.trainer_mesh.tensor, p.trainer_mesh.pipeline, p.trainer_mesh.data) == (2, 2, 2)
    assert Placement.from_config(cfg(gpus_per_node=4)).trainer_mesh.data == 4


def test_an_engine_wider_than_one_gpu_cannot_share_gpus():
    import pytest

    from gymv.cluster.placement import Placement

    with pytest.raises(ValueError, match="cannot share"):
        Placement(num_generation=2, gpus=4, generation_tp=2, generation_per_gpu=2)
