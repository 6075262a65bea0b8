"""MOPD end to end on a real local Ray: a tiny LLaVA student, an image teacher for circle-count and a text-only
teacher for arithmetic (two data-parallel replicas), on a mixed dataset; 3 steps, so batches 2 and 3 are
sampled by refitted weights."""

from __future__ import annotations

import json
import math

import pytest

from gymv.envs.mix import MixPart, write_mixed_dataset
from gymv.errors import GymvError
from gymv.runs.rollout_log import model_calls
from gymv.train import Reporter, train
from tiny_models import tiny_path
from train_helpers import ROLLOUT_RATES, ray_session, step_timing, sync_phases, timing_keys, write_recipe

pytestmark = pytest.mark.slow

COUNT, ARITH = "circle_count_simple_agent", "arithmetic_simple_agent"


@pytest.fixture(scope="module", autouse=True)
def ray():
    stop = ray_session()
    yield
    stop()


class Recorder(Reporter):
    def __init__(self):
        self.refits: list[tuple[int, list[dict]]] = []

    def on_refit(self, step, cluster):
        self.refits.append((step, cluster.generation_stats()))


def _settings(tmp, data, **extra):
    from gymv.backends.teacher import save_text_model
    from gymv.models.tiny import init_tiny

    vlm_teacher = tmp / "count-teacher"
    if not vlm_teacher.exists():
        init_tiny("tiny-llava", vlm_teacher, hidden=64, layers=1)  # same tokenizer (seed 0), other weights
        save_text_model(vlm_teacher, tmp / "arith-teacher")
    s = {
        "model.path": str(tiny_path("tiny-llava")), "model.max_seq_len": 256,
        "env.name": "circle-count", "env.max_turns": 1,
        "data.train": str(data["train"]), "data.eval": str(data["eval"]), "data.prepare": None,
        "generation.max_new_tokens": 6, "generation.reset_encoder_cache_after_weight_update": True,
        "training.lr": 1.0e-3,
        "mopd.prompts_per_step": 3, "mopd.max_steps": 3, "mopd.val_period": 0, "mopd.val_prompts": 2,
        "mopd.teachers": {"_override_": True,
                          "counting": {"path": str(vlm_teacher)},
                          "arith": {"path": str(tmp / "arith-teacher"), "data_parallel_size": 2}},
        "mopd.agent_to_teacher": {"_override_": True, COUNT: "counting", ARITH: "arith"},
        "checkpoint.dir": str(tmp / "runs"), "checkpoint.period": 3,
        "cluster.ray_address": None,
    }
    s.update(extra)
    return s


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mopd-data")
    parts = [MixPart("circle-count", "tiny", 6), MixPart("arithmetic", "tiny", 6)]
    out = {split: tmp / f"{split}.jsonl" for split in ("train", "eval")}
    for split, path in out.items():
        write_mixed_dataset(path, parts, split=split)
    return out


@pytest.fixture(scope="module")
def mopd_run(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("mopd")
    recipe = write_recipe(tmp, "mopd-e2e", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml",
                          _settings(tmp, data, **{"mopd.seq_logprob_error_threshold": 2.0}))
    rec = Recorder()
    summary = train(recipe, reporter=rec)
    return summary, rec, tmp / "runs" / "mopd-e2e", tmp


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _rollouts(run, step):
    return [json.loads(line) for line in (run / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def test_three_steps_train_with_a_reverse_kl_to_each_teacher(mopd_run):
    summary, _, run, _ = mopd_run
    rows = _metrics(run)
    assert summary["complete"] and [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("train/loss", "train/grad_norm", "train/kl_teacher/counting", "train/kl_teacher/arith",
                    "train/kl_teacher", "timing/teacher_s"):
            assert math.isfinite(r[key]), key
        # other weights than the student (a sampled k1 estimate: nonzero, of either sign on a few tokens)
        assert abs(r["train/kl_teacher/counting"]) > 1e-3 and abs(r["train/kl_teacher/arith"]) > 1e-3
        assert r["train/grad_norm"] > 0


def test_every_timing_key_is_a_phase_of_the_steps_timer_teacher_scoring_included(mopd_run):
    _, _, run, _ = mopd_run
    for r in _metrics(run):
        assert timing_keys(r) == step_timing(*sync_phases(), "teacher", rates=ROLLOUT_RATES)
        inside = ("generation_s", "teacher_s", "logprobs_s", "training_s", "refit_s")
        assert sum(r[f"timing/{k}"] for k in inside) <= r["timing/step_s"]


def test_no_sequence_is_masked_for_logprob_error_when_generator_and_trainer_agree(mopd_run):
    _, _, run, _ = mopd_run
    for r in _metrics(run):  # the reference MOPD smoke's health figure
        assert r["train/num_masked_seqs_by_logprob_error"] == 0.0
        assert 1.0 <= r["train/max_seq_mult_prob_error"] < 1.05


def test_each_step_logs_the_teacher_advantages_range_and_its_teacher_batches(mopd_run):
    _, _, run, _ = mopd_run
    replicas = {"counting": 1, "arith": 2}  # data_parallel_size: one batch per replica given rows
    for r in _metrics(run):
        assert r["train/teacher_advantage_min"] <= r["train/teacher_advantage"] <= r["train/teacher_advantage_max"]
        assert r["train/num_teacher_batches"] == sum(n for a, n in replicas.items() if f"train/num_sequences/{a}" in r)


def test_top_k_distillation_trains_on_each_teachers_candidates(tmp_path, data):
    settings = _settings(tmp_path, data, **{"mopd.top_k": 4, "mopd.max_steps": 2, "checkpoint.period": 2})
    recipe = write_recipe(tmp_path, "mopd-topk", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings)
    assert train(recipe)["complete"]
    rows = _metrics(tmp_path / "runs" / "mopd-topk")
    for r in rows:
        # KL over the teacher's 4 candidates, renormalised: other weights than the student's, so above 0
        assert r["train/topk_kl"] > 1e-3 and math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0


def test_every_episode_is_scored_by_the_teacher_of_its_agent(mopd_run):
    _, _, run, _ = mopd_run
    for step in (1, 2, 3):
        recs = _rollouts(run, step)
        assert {r["agent_ref"]["name"] for r in recs} == {COUNT, ARITH}
        for r in recs:
            want = {COUNT: "counting", ARITH: "arith"}[r["agent_ref"]["name"]]
            assert r["_gymv"]["teacher"] == want


def test_later_batches_are_sampled_by_refitted_weights(mopd_run):
    _, _, run, _ = mopd_run
    versions = [{r["_gymv"]["weights_version"] for r in _rollouts(run, s)} for s in (1, 2, 3)]
    assert versions == [{0}, {1}, {2}]


def test_the_student_generator_resets_its_encoder_cache_after_each_refit(mopd_run):
    _, rec, _, _ = mopd_run
    assert [s for s, _ in rec.refits] == [1, 2, 3]
    for step, stats in rec.refits:
        assert all(g["encoder_cache_resets"] == step == g["weights_version"] for g in stats)


def test_async_mopd_with_age_zero_reproduces_the_synchronous_run(mopd_run, data):
    _, _, sync_run, tmp = mopd_run
    settings = _settings(tmp, data, **{"mopd.seq_logprob_error_threshold": 2.0, "mopd.async.enabled": True,
                                       "mopd.async.max_trajectory_age_steps": 0})
    train(write_recipe(tmp, "mopd-async0", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings))
    async_run = tmp / "runs" / "mopd-async0"
    for a, b in zip(_metrics(sync_run), _metrics(async_run), strict=True):
        for key in ("train/loss", "train/grad_norm", "train/reward_mean", "train/teacher_advantage",
                    "train/kl_teacher/counting", "train/kl_teacher/arith", "train/num_teacher_batches",
                    "train/max_seq_mult_prob_error"):
            assert a.get(key) == b.get(key), (a["step"], key)
        assert b["async/age_max"] == 0.0
    for step in (1, 2, 3):
        assert [_scored(r) for r in _rollouts(sync_run, step)] == [_scored(r) for r in _rollouts(async_run, step)]


def _scored(record) -> tuple:
    """A rollout as trained: its teacher, and each model call's tokens and sampling logprobs."""
    calls = [(c["prompt_token_ids"], c["generation_token_ids"], c["generation_log_probs"]) for c in model_calls(record)]
    return record["_gymv"]["teacher"], calls


def test_one_off_async_mopd_scores_the_rows_it_trains_with_weights_at_most_a_step_old(mopd_run, data):
    _, _, _, tmp = mopd_run
    rec = Recorder()
    settings = _settings(tmp, data, **{"mopd.async.enabled": True, "mopd.max_steps": 4})
    train(write_recipe(tmp, "mopd-async1", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings), reporter=rec)
    rows = _metrics(tmp / "runs" / "mopd-async1")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and max(r["async/age_max"] for r in rows) == 1.0
    for r in rows:  # every trained episode was scored by its teacher: 3 prompts x 1 generation a step
        assert sum(r.get(f"train/num_sequences/{a}", 0) for a in ("counting", "arith")) == 3 == r["train/num_sequences"]
    # refits are quiesced: each lands between rollouts and resets the encoder cache before the next image
    for step, stats in rec.refits:
        assert all(g["encoder_cache_resets"] == step == g["weights_version"] for g in stats)


def test_an_agent_without_a_teacher_stops_the_run_naming_it_before_workers_start(mopd_run, data):
    _, _, _, tmp = mopd_run
    settings = _settings(tmp, data, **{"mopd.agent_to_teacher": {"_override_": True, COUNT: "counting"}})
    recipe = write_recipe(tmp, "mopd-unroutable", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings)
    with pytest.raises(GymvError, match=f"no teacher for agent '{ARITH}'") as e:
        train(recipe)
    assert str(data["train"]) in (e.value.where or "")
    assert not (tmp / "runs" / "mopd-unroutable" / "checkpoints").exists() or not any(
        (tmp / "runs" / "mopd-unroutable" / "checkpoints").iterdir())


def test_a_teacher_with_another_vocabulary_stops_the_run_once_naming_it_and_is_never_restarted(mopd_run, data):
    """The teacher's vocabulary check raises in its worker's constructor: the same launch would fail the same
    way again, so it is that error (exit 2), not a lost worker (exit 75) restarted --max-restarts times."""
    from gymv.cluster.ray_placement import LOST_EXIT
    from gymv.models.tiny import init_tiny

    _, _, _, tmp = mopd_run
    other = init_tiny("tiny-llava", tmp / "other-vocab-teacher", hidden=64, layers=1, vocab_size=900)
    settings = _settings(tmp, data, **{"mopd.teachers": {"_override_": True, "counting": {"path": str(other)},
                                                          "arith": {"path": str(tmp / "arith-teacher")}}})
    recipe = write_recipe(tmp, "mopd-other-vocab", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings)
    said = []

    class Messages(Reporter):
        def on_message(self, text):
            said.append(text)

    with pytest.raises(GymvError) as e:
        train(recipe, max_restarts=3, reporter=Messages())
    assert e.value.exit_code == 2 != LOST_EXIT
    assert e.value.where == "mopd.teachers.counting.path"
    assert e.value.message.startswith("teacher 'counting' does not share the student's tokenizer (900 vs 1024 tokens")
    assert "tokenizer" in e.value.fix and not [m for m in said if m.startswith("restart")]


def test_async_mopd_with_a_teacher_that_cannot_start_prints_one_error_line_and_no_worker_traceback(mopd_run, data):
    """Run as a user runs it (a subprocess, its own Ray): the teacher's constructor error is the only error line;
    none of the worker's traceback reaches the terminal (Ray forwards an actor's creation failure there)."""
    from conftest import run_gymv
    from gymv.models.tiny import init_tiny
    from train_helpers import plugin_env

    _, _, _, tmp = mopd_run
    other = tmp / "other-vocab-teacher"
    if not other.exists():
        init_tiny("tiny-llava", other, hidden=64, layers=1, vocab_size=900)
    settings = _settings(tmp, data, **{"mopd.teachers": {"_override_": True, "counting": {"path": str(other)},
                                                          "arith": {"path": str(tmp / "arith-teacher")}},
                                       "mopd.importance_sampling.kind": "truncated",
                                       "checkpoint.dir": str(tmp / "runs-cli")})
    recipe = write_recipe(tmp, "mopd-async-other-vocab", "vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", settings)
    result = run_gymv("train", recipe, "--async", "--max-restarts", "2", env=plugin_env())
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.code == 2 and len(errors) == 1 and "does not share the student's tokenizer" in errors[0]
    leaked = [ln for ln in result.stderr.splitlines() if "Traceback" in ln or 'File "' in ln or "GymvError" in ln]
    assert leaked == [] and "restart" not in result.stderr


def _gpu_cfg(placement: str, gpus, dp: int):
    from gymv.config import load_recipe
    from train_helpers import REPO

    teacher = f"{{path: embedded:tiny-llava, backend: torch, placement: {placement}, data_parallel_size: {dp}" + (
        f", gpus: {gpus}}}" if gpus is not None else "}")
    overrides = ["cluster.gpus_per_node=8", "training.backend=fsdp2", "mopd.prompts_per_step=8", f"mopd.teachers={{t: {teacher}}}",
                 "mopd.agent_to_teacher={circle_count_simple_agent: t}"]
    if placement == "separate":
        overrides += ["cluster.colocated=false", "cluster.generation_gpus=2", "cluster.training_gpus=2"]
    return load_recipe(REPO / "recipes/vlm/vlm_mopd-tinyllava-1n0g-torch.yaml", overrides).validated


def test_a_separate_gpu_teacher_gets_its_own_placement_group_split_over_its_replicas():
    from ray.util.placement_group import remove_placement_group

    from gymv.cluster.teachers import replica_options

    opts, pg = replica_options(_gpu_cfg("separate", 4, 2), "t")
    try:
        assert pg is not None and pg.bundle_count == 2 and pg.bundle_specs == [{"GPU": 2.0, "CPU": 1.0}] * 2
        assert [o["num_gpus"] for o in opts] == [2, 2]
        assert [o["scheduling_strategy"].placement_group_bundle_index for o in opts] == [0, 1]
    finally:
        remove_placement_group(pg)


def test_a_colocated_gpu_teacher_joins_the_policy_bundles_beside_generation_and_training():
    from ray.util.placement_group import placement_group, remove_placement_group

    from gymv.train.mopd import COLOCATED_POLICY_SHARE
    from gymv.cluster.teachers import COLOCATED_SHARE, replica_options

    policy_pg = placement_group([{"CPU": 0.01}] * 2)
    try:
        opts, pg = replica_options(_gpu_cfg("colocated", None, 3), "t", policy_pg=policy_pg)
        assert pg is None and all(o["num_gpus"] == COLOCATED_SHARE for o in opts)
        assert [o["scheduling_strategy"].placement_group_bundle_index for o in opts] == [0, 1, 0]
        assert all(o["scheduling_strategy"].placement_group is policy_pg for o in opts)
        assert 2 * COLOCATED_POLICY_SHARE + COLOCATED_SHARE <= 1.0
    finally:
        remove_placement_group(policy_pg)


def test_a_colocated_teacher_without_a_shared_policy_placement_is_refused():
    from gymv.cluster.teachers import replica_options

    with pytest.raises(GymvError, match="cluster.colocated: false"):
        replica_options(_gpu_cfg("colocated", None, 1), "t", policy_pg=None)
