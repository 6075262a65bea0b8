"""Training data: generated splits, the deterministic row stream a checkpoint can resume, routing rows to
environments, and where a run's policy starts (SFT warm start)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from gymv.errors import GymvError
from gymv.runs.checkpoint import DataPosition
from gymv.config.schema import EnvSection
from gymv.envs.routing import EnvRouter
from gymv.train.data import Row, RowStream, epoch_order, read_rows, training_rows
from gymv.train.setup import resolve_init_path, step_seed


def _rows(n):
    return [Row(i, {"i": i}, f"rows.jsonl line {i + 1}") for i in range(n)]


def test_each_epoch_is_a_permutation_that_depends_only_on_seed_and_epoch():
    a, b = epoch_order(10, 3, 0), epoch_order(10, 3, 1)
    assert sorted(a) == sorted(b) == list(range(10))
    assert a != b and a == epoch_order(10, 3, 0) and a != epoch_order(10, 4, 0)


def test_batches_run_across_epoch_boundaries_without_dropping_rows():
    stream = RowStream(_rows(5), seed=1)
    seen = [r.index for _ in range(4) for r in stream.next_batch(3)]
    assert sorted(seen[:5]) == list(range(5)) and sorted(seen[5:10]) == list(range(5))
    assert stream.position == DataPosition(epoch=2, index=2, shuffle_seed=1)


def test_a_stream_restarted_from_its_position_continues_identically():
    whole = RowStream(_rows(7), seed=9)
    first = [whole.next_batch(3) for _ in range(2)]
    saved = whole.position
    rest = [[r.index for r in whole.next_batch(3)] for _ in range(4)]
    resumed = RowStream(_rows(7), seed=9, position=saved)
    assert [[r.index for r in resumed.next_batch(3)] for _ in range(4)] == rest
    assert first  # (drawn before the save)


def test_a_peeked_batch_is_the_next_one_and_leaves_the_position_across_an_epoch_boundary():
    stream = RowStream(_rows(5), seed=4)
    stream.next_batch(3)
    before = stream.position
    peeked = [r.index for r in stream.peek_batch(3)]
    assert stream.position == before
    assert [r.index for r in stream.next_batch(3)] == peeked


def test_shuffle_off_keeps_file_order():
    assert [r.index for r in RowStream(_rows(4), seed=0, shuffle=False).next_batch(4)] == [0, 1, 2, 3]


def test_step_seeds_differ_by_step_and_kind_and_repeat_exactly():
    assert step_seed(1, 2) == step_seed(1, 2) != step_seed(1, 3)
    assert step_seed(1, 2, "val") != step_seed(1, 2)


def _cfg(tmp_path, **data):
    prepare = SimpleNamespace(n_train=6, n_eval=3, preset="tiny", knobs={"circles": [1, 2]}, seed=5)
    return SimpleNamespace(env=SimpleNamespace(name="circle-count"),
                           data=SimpleNamespace(train=data.get("train"), eval=data.get("eval"), prepare=data.get("prepare", prepare)))


def test_prepare_writes_disjoint_train_and_eval_splits_into_the_run(tmp_path):
    train, evals = training_rows(_cfg(tmp_path), tmp_path)
    assert (len(train), len(evals)) == (6, 3)
    assert (tmp_path / "data" / "train.jsonl").exists() and (tmp_path / "data" / "eval.jsonl").exists()
    assert not {json.dumps(r.data, sort_keys=True) for r in train} & {json.dumps(r.data, sort_keys=True) for r in evals}
    assert all(1 <= len(r.data["circles"]) <= 2 for r in train)  # the knob override took effect


def test_prepared_rows_are_reused_by_a_later_launch(tmp_path):
    training_rows(_cfg(tmp_path), tmp_path)
    before = (tmp_path / "data" / "train.jsonl").stat().st_mtime_ns
    training_rows(_cfg(tmp_path), tmp_path)
    assert (tmp_path / "data" / "train.jsonl").stat().st_mtime_ns == before


def test_no_data_source_is_an_error(tmp_path):
    with pytest.raises(GymvError, match="no training data"):
        training_rows(_cfg(tmp_path, prepare=None), tmp_path)


def test_rows_naming_an_unknown_agent_fail_naming_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    good = {"responses_create_params": {"input": "hi"}, "circles": [], "target_color": "red",
            "agent_ref": {"type": "responses_api_agents", "name": "circle_count_simple_agent"}}
    bad = {**good, "agent_ref": {"type": "responses_api_agents", "name": "weather_agent"}}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(GymvError) as err:
        EnvRouter(EnvSection(name="circle-count")).check(read_rows(str(path)))
    assert "weather_agent" in str(err.value) and "line 2" in str(err.value)


def test_rows_naming_another_installed_environment_go_there():
    router = EnvRouter(EnvSection(name="circle-count"))
    assert router({"agent_ref": {"name": "circle_click_simple_agent"}}).name == "circle-click"
    assert router({}).name == "circle-count"


# -- where the policy starts -------------------------------------------------------------------------------


@pytest.fixture()
def sft_run(tmp_path):
    """A run directory shaped like `gymv train` leaves it: checkpoints/step_N (HF-loadable), latest, final/."""
    from tiny_models import tiny_path

    run = tmp_path / "runs" / "sft"
    for step in (1, 2):
        d = run / "checkpoints" / f"step_{step}"
        shutil.copytree(tiny_path("tiny-llava"), d)
        (d / "state.json").write_text(json.dumps({"step": step, "data_position": {}}))
    (run / "checkpoints" / "latest").write_text("step_2\n")
    return run


def test_model_path_may_name_a_runs_latest_checkpoint(sft_run):
    assert resolve_init_path(str(sft_run / "checkpoints" / "latest")) == str(sft_run / "checkpoints" / "step_2")


def test_model_path_may_name_a_run_preferring_its_final_export(sft_run):
    assert resolve_init_path(str(sft_run)) == str(sft_run / "checkpoints" / "step_2")
    shutil.copytree(sft_run / "checkpoints" / "step_1", sft_run / "final")
    assert resolve_init_path(str(sft_run)) == str(sft_run / "final")


def test_a_missing_model_folder_names_the_recipe_line(tmp_path):
    with pytest.raises(GymvError) as err:
        resolve_init_path(str(tmp_path / "nope"), where="recipes/x.yaml:4")
    assert err.value.where == "recipes/x.yaml:4" and "not found" in err.value.message
