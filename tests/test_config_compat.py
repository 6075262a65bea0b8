"""Cross-field rules (check_compatibility): the same findings feed loader errors and `gymv lint`."""

from __future__ import annotations

import pytest

from gymv.backends.registry import REFIT_TRANSPORTS, TransportCapabilities
from gymv.config import RULES, check_compatibility, validate_config
from gymv.config.schema import RecipeBase

GPU = {"cluster": {"gpus_per_node": 8}}


def cfg(**sections) -> RecipeBase:
    """A config validated by the schema alone, so each rule can be tested on its own. It trains with fsdp2
    unless it names a backend: the torch backend on more than one rank is a rule of its own."""
    from gymv.config.schema import MODELS

    data = deep({"algorithm": "grpo", "training": {"backend": "fsdp2"}}, sections)
    return MODELS[data["algorithm"]].model_validate(data)


def rules_hit(c: RecipeBase, severity: str = "error") -> set[str]:
    return {f.rule for f in check_compatibility(c) if f.severity == severity}


def deep(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = deep(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_the_defaults_break_no_rule():
    from gymv.config.schema import MODELS

    assert check_compatibility(MODELS["grpo"].model_validate({"algorithm": "grpo"})) == []
    assert check_compatibility(cfg()) == []


class CarrierPigeonSender:
    """A plugin transport that declares it leaves the vision encoder's cache alone."""

    capabilities = TransportCapabilities(resets_encoder_cache=False, lag_safe=True)


@pytest.fixture
def no_reset_transport():
    REFIT_TRANSPORTS.register("carrier_pigeon", CarrierPigeonSender)
    yield "carrier_pigeon"
    REFIT_TRANSPORTS.unregister("carrier_pigeon")


def test_encoder_cache_reset_with_a_transport_that_cannot_reset_is_an_error(no_reset_transport):
    c = cfg(generation={"reset_encoder_cache_after_weight_update": True}, refit={"transport": no_reset_transport})
    [f] = check_compatibility(c)
    assert f.rule == "refit.encoder-cache-reset" and f.key == "generation.reset_encoder_cache_after_weight_update"
    assert "carrier_pigeon" in f.message and "object_store" in f.fix


def test_the_same_transport_without_the_flag_is_fine(no_reset_transport):
    assert check_compatibility(cfg(refit={"transport": no_reset_transport})) == []


@pytest.mark.parametrize("transport", ["object_store", "shm", "cuda_ipc", "nccl"])
def test_every_builtin_transport_implements_the_encoder_cache_reset(transport):
    c = cfg(generation={"reset_encoder_cache_after_weight_update": True}, refit={"transport": transport}, **GPU)
    assert "refit.encoder-cache-reset" not in rules_hit(c)


def test_async_without_importance_sampling_is_an_error():
    assert rules_hit(cfg(grpo={"async": {"enabled": True}})) == {"async.importance-sampling"}


def test_async_with_truncated_importance_sampling_is_fine_on_cpu():
    assert rules_hit(cfg(grpo={"async": {"enabled": True}, "importance_sampling": {"kind": "truncated"}})) == set()


def test_async_on_colocated_gpus_is_an_error():
    c = cfg(grpo={"async": {"enabled": True}, "importance_sampling": {"kind": "icepop"}}, **GPU)
    assert rules_hit(c) == {"async.separate-gpus"}


ASYNC = {"async": {"enabled": True}, "importance_sampling": {"kind": "truncated"}}


def test_in_flight_weight_updates_with_the_encoder_cache_reset_are_an_error():
    c = cfg(grpo=deep(ASYNC, {"async": {"in_flight_weight_updates": True}}),
            generation={"reset_encoder_cache_after_weight_update": True})
    [f] = check_compatibility(c)
    assert f.rule == "async.in-flight-encoder-cache" and f.key == "grpo.async.in_flight_weight_updates"


def test_in_flight_weight_updates_without_the_reset_are_fine():
    c = cfg(grpo=deep(ASYNC, {"async": {"in_flight_weight_updates": True}}),
            generation={"reset_encoder_cache_after_weight_update": False})
    assert check_compatibility(c) == []


def test_async_with_a_refit_buffer_the_next_publish_overwrites_is_an_error():
    [f] = check_compatibility(cfg(grpo=ASYNC, refit={"transport": "shm"}))
    assert f.rule == "async.refit-transport" and "object_store" in f.fix and "shm" not in f.fix


def test_age_zero_is_a_valid_staleness_bound():
    assert check_compatibility(cfg(grpo=deep(ASYNC, {"async": {"max_trajectory_age_steps": 0}}))) == []


def test_parallel_sizes_must_divide_the_gpus():
    c = cfg(training={"backend": "megatron", "parallel": {"tensor": 3}}, **GPU)
    assert "parallel.divides-gpus" in rules_hit(c)


def test_parallel_sizes_that_divide_the_gpus_are_fine():
    c = cfg(training={"backend": "megatron", "parallel": {"tensor": 2, "pipeline": 2, "context": 2}}, **GPU)
    assert rules_hit(c) == set()


def test_parallel_sizes_divide_the_training_gpus_when_not_colocated():
    split = {"cluster": {"gpus_per_node": 8, "colocated": False, "generation_gpus": 2, "training_gpus": 6},
             "refit": {"transport": "nccl"}}
    assert "parallel.divides-gpus" in rules_hit(cfg(training={"backend": "megatron", "parallel": {"tensor": 4}}, **split))
    assert "parallel.divides-gpus" not in rules_hit(cfg(training={"backend": "megatron", "parallel": {"tensor": 2}}, **split))


def test_expert_parallelism_folds_over_tensor_and_context_ranks_so_tp2_ep8_cp2_fits_8_gpus():
    # experts whole (expert TP 1): EP need only divide the GPUs, not TP x EP (16 here)
    parallel = {"tensor": 2, "expert": 8, "context": 2}
    assert rules_hit(cfg(training={"backend": "megatron", "parallel": parallel}, **GPU)) == set()


def test_an_expert_parallel_size_that_does_not_divide_the_gpus_is_an_error_naming_the_key():
    [f] = check_compatibility(cfg(training={"backend": "megatron", "parallel": {"tensor": 2, "expert": 16}}, **GPU))
    assert (f.rule, f.key) == ("parallel.divides-gpus", "training.parallel.expert") and "expert 16" in f.message


def test_megatron_tensor_parallelism_on_a_cpu_runs_over_its_training_ranks():
    assert rules_hit(cfg(training={"backend": "megatron", "parallel": {"tensor": 2}},
                         cluster={"cpu_training_ranks": 2})) == set()


def test_megatron_tensor_parallelism_on_a_cpu_needs_ranks_it_divides_naming_the_key():
    [f] = check_compatibility(cfg(training={"backend": "megatron", "parallel": {"tensor": 2}}))
    assert f.rule == "parallel.divides-gpus" and "1 training ranks (cluster.cpu_training_ranks)" in f.message


def test_model_parallelism_with_the_torch_backend_is_an_error():
    assert "parallel.backend" in rules_hit(cfg(training={"backend": "torch", "parallel": {"tensor": 2}}, **GPU))


@pytest.mark.parametrize("cluster,key", [
    ({"cpu_training_ranks": 2}, "cluster.cpu_training_ranks"),
    ({"gpus_per_node": 8}, "cluster.gpus_per_node"),
    ({"num_nodes": 2, "gpus_per_node": 1}, "cluster.num_nodes"),
    ({"gpus_per_node": 8, "colocated": False, "generation_gpus": 6, "training_gpus": 2}, "cluster.training_gpus"),
])
def test_the_torch_backend_on_more_than_one_training_rank_is_refused_naming_the_key(cluster, key):
    [f] = [f for f in check_compatibility(cfg(training={"backend": "torch"}, cluster=cluster))
           if f.rule == "training.one-rank"]
    assert f.key == key and f.severity == "error" and "training.backend: fsdp2" in f.fix


@pytest.mark.parametrize("cluster", [{}, {"gpus_per_node": 1},
                                     {"gpus_per_node": 8, "colocated": False, "generation_gpus": 7, "training_gpus": 1}])
def test_the_torch_backend_on_one_training_rank_is_fine(cluster):
    assert "training.one-rank" not in rules_hit(cfg(training={"backend": "torch"}, cluster=cluster))


def test_loading_a_torch_recipe_with_two_cpu_ranks_fails_naming_the_override():
    from gymv.config import load_recipe
    from gymv.errors import GymvError
    from train_helpers import REPO

    with pytest.raises(GymvError, match="training.backend torch trains on one rank, cluster.cpu_training_ranks gives it 2") as e:
        load_recipe(REPO / "recipes/vlm_grpo.yaml", ["cluster.cpu_training_ranks=2"]).validated
    assert "cluster.cpu_training_ranks=2" in e.value.where and "training.backend: fsdp2" in e.value.fix
    assert load_recipe(REPO / "recipes/vlm_grpo.yaml", ["cluster.cpu_training_ranks=2", "training.backend=fsdp2"]).validated


def test_fsdp2_and_megatron_train_on_many_ranks():
    for backend in ("fsdp2", "megatron"):
        assert "training.one-rank" not in rules_hit(cfg(training={"backend": backend}, cluster={"cpu_training_ranks": 2}))
        assert "training.one-rank" not in rules_hit(cfg(training={"backend": backend}, **GPU))


def test_vllm_generation_on_cpu_is_allowed():
    assert rules_hit(cfg(generation={"backend": "vllm"})) == set()


def test_megatron_training_on_cpu_is_allowed():
    assert rules_hit(cfg(training={"backend": "megatron"})) == set()


def test_a_gpu_transport_on_cpu_is_an_error():
    assert rules_hit(cfg(refit={"transport": "nccl"})) == {"refit.transport-placement"}


def test_cuda_ipc_needs_colocated_gpus():
    split = deep(GPU, {"cluster": {"colocated": False, "generation_gpus": 4, "training_gpus": 4}})
    assert rules_hit(cfg(refit={"transport": "cuda_ipc"}, **split)) == {"refit.transport-placement"}


def test_shared_memory_refit_cannot_cross_nodes():
    c = cfg(refit={"transport": "shm"}, cluster={"num_nodes": 2, "gpus_per_node": 8})
    assert rules_hit(c) == {"refit.transport-placement"}


def test_several_generation_workers_per_gpu_with_nccl_refit_is_an_error():
    split = deep(GPU, {"cluster": {"colocated": False, "generation_gpus": 4, "training_gpus": 4,
                                   "generation_workers_per_gpu": 2}})
    assert rules_hit(cfg(refit={"transport": "nccl"}, **split)) == {"refit.transport-workers-per-gpu"}


def test_several_generation_workers_per_gpu_with_object_store_refit_are_fine():
    split = deep(GPU, {"cluster": {"colocated": False, "generation_gpus": 4, "training_gpus": 4,
                                   "generation_workers_per_gpu": 2}})
    assert rules_hit(cfg(**split)) == set()


def test_vllm_tensor_parallel_must_divide_the_generation_gpus():
    c = cfg(generation={"backend": "vllm", "vllm": {"tensor_parallel_size": 3}}, **GPU)
    assert rules_hit(c) == {"vllm.tensor-parallel"}


def test_a_split_larger_than_the_cluster_is_an_error():
    c = cfg(cluster={"gpus_per_node": 8, "colocated": False, "generation_gpus": 4, "training_gpus": 8},
            refit={"transport": "nccl"})
    assert rules_hit(c) == {"cluster.gpu-split"}


def test_idle_gpus_in_a_split_are_a_warning():
    c = cfg(cluster={"gpus_per_node": 8, "colocated": False, "generation_gpus": 2, "training_gpus": 4},
            refit={"transport": "nccl"})
    assert rules_hit(c) == set() and rules_hit(c, "warning") == {"cluster.gpu-split"}


def test_a_split_on_a_colocated_cluster_is_an_error():
    assert rules_hit(cfg(cluster={"gpus_per_node": 8, "training_gpus": 4})) == {"cluster.gpu-split"}


def test_non_colocated_gpus_need_both_counts():
    c = cfg(cluster={"gpus_per_node": 8, "colocated": False, "generation_gpus": 4}, refit={"transport": "nccl"})
    assert [f.key for f in check_compatibility(c)] == ["cluster.training_gpus"]


def test_global_batch_must_divide_the_samples_of_a_step():
    c = cfg(grpo={"prompts_per_step": 4, "generations_per_prompt": 4}, training={"global_batch_size": 6})
    assert "batch.divides-step" in rules_hit(c)


def test_global_batch_must_split_across_data_parallel_ranks():
    c = cfg(grpo={"prompts_per_step": 3, "generations_per_prompt": 4}, training={"global_batch_size": 12}, **GPU)
    assert rules_hit(c) == {"batch.data-parallel"}


def test_a_rollout_longer_than_the_context_is_an_error():
    assert rules_hit(cfg(model={"max_seq_len": 512}, env={"max_rollout_tokens": 1024})) == {"rollout.fits-context"}


def test_no_training_data_source_is_an_error():
    assert rules_hit(cfg(data={"prepare": None})) == {"data.source"}


def test_leave_one_out_needs_two_generations():
    c = cfg(grpo={"generations_per_prompt": 1}, training={"global_batch_size": 8})
    assert rules_hit(c) == {"grpo.leave-one-out"}


def test_greedy_grpo_is_a_warning():
    assert rules_hit(cfg(generation={"temperature": 0}), "warning") == {"grpo.greedy"}


def mopd(**mopd_section) -> RecipeBase:
    section = deep({"teachers": {"a": {"path": "x"}}}, mopd_section)
    return cfg(algorithm="mopd", mopd=section)


def test_mopd_routing_to_an_undefined_teacher_is_an_error():
    [f] = check_compatibility(mopd(agent_to_teacher={"circle_count_simple_agent": "b"}))
    assert f.rule == "mopd.routing" and f.key == "mopd.agent_to_teacher.circle_count_simple_agent"


def test_mopd_non_strict_matching_needs_a_default_teacher():
    assert rules_hit(mopd(strict_agent_name_match=False)) == {"mopd.routing"}
    assert rules_hit(mopd(strict_agent_name_match=False, default_teacher_alias="a")) == set()


def test_a_default_teacher_under_strict_matching_is_an_error_naming_both_keys_and_the_fix():
    [f] = check_compatibility(mopd(default_teacher_alias="a"))
    assert (f.rule, f.key, f.severity) == ("mopd.routing", "mopd.default_teacher_alias", "error")
    assert "mopd.strict_agent_name_match is true" in f.message and "never used" in f.message
    assert "strict_agent_name_match: false" in f.fix and "remove mopd.default_teacher_alias" in f.fix


def test_async_mopd_follows_async_grpos_rules_naming_its_own_keys():
    [f] = check_compatibility(mopd(**{"async": {"enabled": True}}))
    assert (f.rule, f.key) == ("async.importance-sampling", "mopd.importance_sampling.kind")
    icepop = {"importance_sampling": {"kind": "icepop"}}
    assert rules_hit(mopd(**{"async": {"enabled": True}}, **icepop)) == set()
    in_flight = deep({"teachers": {"a": {"path": "x"}}, "async": {"enabled": True, "in_flight_weight_updates": True}},
                     icepop)
    [f] = check_compatibility(cfg(algorithm="mopd", mopd=in_flight,
                                  generation={"reset_encoder_cache_after_weight_update": True}))
    assert (f.rule, f.key) == ("async.in-flight-encoder-cache", "mopd.async.in_flight_weight_updates")


def test_mopd_default_teacher_must_exist():
    assert rules_hit(mopd(default_teacher_alias="zzz")) == {"mopd.routing"}


def test_vllm_and_megatron_teachers_on_cpu_are_allowed():
    assert rules_hit(mopd(teachers={"a": {"backend": "vllm"}})) == set()
    assert rules_hit(mopd(teachers={"a": {"backend": "megatron"}})) == set()


def test_a_separate_teacher_on_gpus_needs_gpus_divisible_by_its_replicas():
    base = {"cluster": {"gpus_per_node": 8, "colocated": False, "generation_gpus": 2, "training_gpus": 4},
            "refit": {"transport": "nccl"}}
    ok = cfg(algorithm="mopd", mopd={"teachers": {"a": {"path": "x", "placement": "separate", "gpus": 2,
                                                         "data_parallel_size": 2}}}, **base)
    bad = cfg(algorithm="mopd", mopd={"teachers": {"a": {"path": "x", "placement": "separate", "gpus": 3,
                                                          "data_parallel_size": 2}}}, **base)
    assert rules_hit(ok) == set() and rules_hit(bad) == {"mopd.teacher-gpus", "cluster.gpu-split"}


def _split_teacher(**teacher):
    base = {"cluster": {"gpus_per_node": 8, "colocated": False, "generation_gpus": 2, "training_gpus": 4},
            "refit": {"transport": "nccl"}}
    return cfg(algorithm="mopd", mopd={"teachers": {"a": {"path": "x", "placement": "separate", **teacher}}}, **base)


def test_a_vllm_teacher_spans_tensor_parallel_gpus_with_its_experts_split_over_them():
    assert rules_hit(_split_teacher(backend="vllm", gpus=2, tensor_parallel_size=2, expert_parallel_size=2)) == set()
    assert rules_hit(_split_teacher(backend="vllm", gpus=2, tensor_parallel_size=2)) == set()


def test_a_megatron_teachers_experts_split_over_any_divisor_of_its_tensor_parallel_ranks():
    cluster = {"gpus_per_node": 8, "num_nodes": 2, "colocated": False, "generation_gpus": 4, "training_gpus": 4}
    for ep in (8, 4, 1):  # the Super Omni teacher is TP 8 x EP 8 on a node of its own: its EP group is its TP group
        teacher = {"path": "x", "placement": "separate", "backend": "megatron", "gpus": 8, "tensor_parallel_size": 8,
                   "expert_parallel_size": ep}
        c = cfg(algorithm="mopd", mopd={"teachers": {"a": teacher}}, cluster=cluster, refit={"transport": "nccl"})
        assert rules_hit(c) == set()


@pytest.mark.parametrize("teacher,key", [
    ({"backend": "torch", "gpus": 2, "tensor_parallel_size": 2}, "tensor_parallel_size"),  # one device a replica
    ({"backend": "vllm", "gpus": 2, "tensor_parallel_size": 2, "expert_parallel_size": 4}, "expert_parallel_size"),
    ({"backend": "vllm", "gpus": 4, "tensor_parallel_size": 4, "expert_parallel_size": 2}, "expert_parallel_size"),
    ({"backend": "megatron", "gpus": 4, "tensor_parallel_size": 4, "expert_parallel_size": 3}, "expert_parallel_size"),
    ({"backend": "vllm", "gpus": 1, "data_parallel_size": 1, "tensor_parallel_size": 2}, "gpus"),  # dp x tp GPUs
])
def test_teacher_parallel_sizes_that_do_not_fit_are_refused_naming_the_key(teacher, key):
    found = [f for f in check_compatibility(_split_teacher(**teacher)) if f.rule == "teacher.parallel"]
    assert found and found[0].key == f"mopd.teachers.a.{key}"


def test_a_colocated_teacher_cannot_span_gpus():
    c = cfg(algorithm="mopd", mopd={"teachers": {"a": {"path": "x", "backend": "vllm", "tensor_parallel_size": 2}}})
    assert "teacher.parallel" in rules_hit(c)


def test_every_rule_has_a_unique_id_and_a_summary():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)) and all(r.summary for r in RULES)


def test_the_loader_raises_compatibility_errors_but_validate_config_alone_does_not():
    data = {"algorithm": "grpo", "generation": {"backend": "vllm"}}
    assert validate_config(data).generation.backend == "vllm"


def test_colocated_gpus_take_their_placement_from_the_training_role():
    pinned = {"placement": {"generation": {"labels": {"gymv-node": "0"}}}}
    assert "cluster.placement-colocated" in rules_hit(cfg(cluster={"gpus_per_node": 8, **pinned}))
    assert "cluster.placement-colocated" not in rules_hit(cfg(cluster={"gpus_per_node": 0, **pinned}))
    assert "cluster.placement-colocated" not in rules_hit(
        cfg(cluster={"gpus_per_node": 8, "colocated": False, "generation_gpus": 4, "training_gpus": 4, **pinned}))


def test_static_decoding_with_a_backend_that_declares_no_decoder_is_an_error():
    [f] = check_compatibility(cfg(generation={"backend": "vllm", "decode": "static"}))
    assert (f.rule, f.key) == ("generation.decode-backend", "generation.decode") and "generation.backend hf" in f.message
    assert check_compatibility(cfg(generation={"decode": "static"})) == []
