"""`gymv train` as a user runs it: bad input is one line naming what to fix, exit code 2, no traceback."""

from __future__ import annotations

import json

import pytest

from gymv.errors import GymvError
from gymv.train import train
from tiny_models import tiny_path
from train_helpers import no_shared_ray, plugin_env, ray_module, plugin_on_path, tiny_grpo_settings, write_recipe


@pytest.fixture(scope="module", autouse=True)
def plugin():
    with plugin_on_path():
        yield


@pytest.fixture()
def recipe(tmp_path):
    def make(**extra):
        return write_recipe(tmp_path, "cli", "vlm_grpo.yaml", tiny_grpo_settings(tmp_path, tiny_path("tiny-llava"), **extra))

    return make


def _one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_help_shows_an_example(gymv):
    result = gymv("train", "--help")
    assert result.code == 0 and "gymv train recipes/" in result.stdout


def test_missing_model_directory_names_the_recipe_line(gymv, recipe, tmp_path):
    path = recipe(**{"model.path": str(tmp_path / "no-such-model")})
    result = gymv("train", path, env=plugin_env())
    line = _one_error_line(result)
    assert result.code == 2
    assert f"{path.name}:" in line and "model folder not found" in line and "no-such-model" in line
    assert not (tmp_path / "runs").exists()  # nothing written for a run that cannot start


def test_rows_of_an_environment_nobody_configured_fail_before_ray_starts(recipe, tmp_path):
    no_shared_ray()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"responses_create_params": {"input": "hi"}, "parity": 0,
                                "agent_ref": {"type": "responses_api_agents", "name": "chess_agent"}}) + "\n")
    with pytest.raises(GymvError) as err:
        train(recipe(**{"data.train": str(rows)}))
    assert "chess_agent" in str(err.value) and "rows.jsonl line 1" in str(err.value)
    assert not ray_is_up()


def test_a_ray_cluster_that_cannot_be_reached_is_one_clear_error(recipe):
    no_shared_ray()
    with pytest.raises(GymvError, match="cannot reach a Ray cluster at 127.0.0.1:1") as err:
        train(recipe(), ray_address="127.0.0.1:1")
    assert err.value.exit_code == 2


def test_joining_another_cluster_while_connected_to_one_is_refused_naming_both(recipe):
    import ray

    with ray_module():
        current = ray.get_runtime_context().gcs_address
        with pytest.raises(GymvError, match=f"already connected to the Ray cluster at {current}, not 127.0.0.1:1"):
            train(recipe(), ray_address="127.0.0.1:1")
        assert ray.get_runtime_context().gcs_address == current


def test_resume_of_a_folder_that_is_not_a_run_is_refused(recipe, tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    with pytest.raises(GymvError, match="no config.yaml"):
        train(None, resume_dir=str(other))
    with pytest.raises(GymvError, match="no config.yaml"):
        train(recipe(), resume_dir=str(other))
    assert list(other.iterdir()) == []  # nothing written into it


def ray_is_up() -> bool:
    import ray

    return ray.is_initialized()


@pytest.mark.slow
def test_a_launch_that_stopped_before_its_first_step_is_started_afresh_by_the_next(recipe, tmp_path):
    """A typo that fails after the run directory is written (a data path) must not become the run's config,
    nor make the corrected launch a 'config change'."""
    path = recipe()
    for typo in ("missing-1.jsonl", "missing-2.jsonl"):
        with pytest.raises(GymvError, match="file not found"):
            train(path, [f"data.train={tmp_path / typo}", "grpo.val_period=0"])
    run = tmp_path / "runs" / "cli"
    assert "missing-2.jsonl" in (run / "config.yaml").read_text()
    assert not (run / "config_changes.jsonl").exists()
    stale = run / "data" / "eval.jsonl"
    stale.write_text("rows prepared by the broken launch\n")
    with pytest.raises(GymvError, match="file not found"):  # rows prepared by an earlier launch are not reused
        train(path, [f"data.train={tmp_path / 'missing-3.jsonl'}", "data.prepare.n_eval=3"])
    assert not (run / "config_changes.jsonl").exists() and len(stale.read_text().splitlines()) == 3


@pytest.mark.parametrize("args,named,bound", [
    (["--max-restarts", "101"], "--max-restarts", "less than or equal to 100"),
    (["--max-restarts", "-1"], "--max-restarts", "greater than or equal to 0"),
    (["cluster.max_restarts=1000000"], "cluster.max_restarts", "less than or equal to 100"),
])
def test_a_restart_count_out_of_0_to_100_is_refused_in_one_line(gymv, recipe, tmp_path, args, named, bound):
    result = gymv("train", recipe(), *args, env=plugin_env())
    errors = [ln for ln in result.stderr.splitlines() if ln.lower().startswith("error:")]
    assert result.code == 2 and len(errors) == 1 and "Traceback" not in result.stderr
    assert named in errors[0] and bound in errors[0]
    assert not (tmp_path / "runs").exists()


def _run_dir_with_metrics(recipe_path, run, lines: list[str]):
    """A run directory as a launch leaves it (its config), with `lines` as its metrics.jsonl."""
    from gymv.runs.run_dir import RunDir
    from gymv.train import load_training_recipe

    RunDir.create(run, load_training_recipe(recipe_path).validated.to_dict())
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


def test_resuming_a_run_whose_metrics_have_a_row_without_a_step_fails_before_ray_starts(gymv, recipe, tmp_path):
    no_shared_ray()
    run = _run_dir_with_metrics(recipe(), tmp_path / "runs" / "cli",
                                ['{"step": 1, "train/loss": 0.5}', '{"step": null}', '{"step": 2}'])
    result = gymv("train", "--resume", run, env=plugin_env())
    line = _one_error_line(result)
    assert result.code == 2 and f"{run / 'metrics.jsonl'}:2" in line and "`step` is null" in line
    assert not ray_is_up() and not (run / "checkpoints").exists()


@pytest.mark.parametrize("how", ["override", "recipe"])
def test_resuming_with_another_algorithm_is_refused_saying_how_to_start_from_its_weights(gymv, recipe, tmp_path, how):
    from train_helpers import REPO

    run = _run_dir_with_metrics(recipe(), tmp_path / "runs" / "cli", [])
    args = (["--resume", run, "algorithm=vlm_sft"] if how == "override" else
            [REPO / "recipes" / "vlm" / "vlm_sft-tinyomni-1n0g-torch.yaml", "--resume", run])
    line = _one_error_line(gymv("train", *args, env=plugin_env()))
    assert "holds a vlm_grpo run: --resume continues it as recorded, and algorithm vlm_sft" in line
    assert f"model.path={run}" in line and "NeMo RL" not in line
    assert ("<command line: algorithm=vlm_sft>" in line) == (how == "override")


def test_a_delete_override_after_resume_is_an_override_not_a_recipe(gymv, recipe, tmp_path):
    run = _run_dir_with_metrics(recipe(), tmp_path / "runs" / "cli", [])
    line = _one_error_line(gymv("train", "--resume", run, "~vision", env=plugin_env()))
    assert "vlm_grpo needs a `vision:` section" in line and "file not found" not in line
