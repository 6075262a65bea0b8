"""`gymv smoke` without training: which recipes a target names, how each is shrunk (smoke:, --steps, --tiny) into
a recipe that validates, how checks are judged against a run's metrics, JUnit XML, and failures that never stop
a suite (a recipe that does not load, a run that hangs)."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gymv.config import load_recipe
from gymv.backends.registry import TRAINING_BACKENDS
from gymv.errors import GymvError
from gymv.smoke import (
    DEFAULT_STEPS,
    PreparedRun,
    SmokeTarget,
    evaluate_run,
    junit_xml,
    prepare_run,
    resolve_targets,
    run_smoke,
    run_training,
)
from gymv.smoke.run import TrainOutcome
from conftest import REPO
from report_run import make_run

GRPO = REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"
GPU_RECIPES = sorted(p for p in (REPO / "recipes").glob("*/*.yaml") if "n8g" in p.name)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- targets ----------------------------------------------------------------------------------------------


def test_a_suite_name_runs_its_recipes_in_order_each_with_its_driver():
    targets = resolve_targets(["release"])
    listed = [ln.split("#")[0].strip() for ln in (REPO / "recipes/suites/release.txt").read_text().splitlines()]
    assert [t.shown for t in targets] == ["recipes/" + x for x in listed if x]
    assert all(t.suite == "release" and t.driver is not None and t.driver.is_file() for t in targets)


def test_a_recipe_named_twice_runs_once():
    assert len(resolve_targets([str(GRPO), "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"])) == 1


def test_a_target_that_is_neither_recipe_nor_suite_is_a_usage_error():
    with pytest.raises(GymvError, match="neither a recipe file nor a suite") as e:
        resolve_targets(["nightlly"])
    assert "nightly" in e.value.fix


# -- preparing a recipe ------------------------------------------------------------------------------------


def prepared(tmp_path, recipe=GRPO, **kw) -> PreparedRun:
    return prepare_run(SmokeTarget(Path(recipe)), out_dir=tmp_path / "out", name="r", **kw)


def run_config(p: PreparedRun) -> dict:
    return load_recipe(p.config_file).validated.to_dict()


def test_the_recipes_smoke_section_sets_the_steps(tmp_path):
    p = prepared(tmp_path)
    cfg = run_config(p)
    assert (p.max_steps, p.steps_from) == (2, "smoke:")
    assert (cfg["grpo"]["max_steps"], cfg["data"]["prepare"]["n_train"], cfg["grpo"]["val_period"]) == (2, 8, 0)


def test_steps_flag_wins_over_the_smoke_section(tmp_path):
    p = prepared(tmp_path, steps=3)
    assert (p.max_steps, p.steps_from, run_config(p)["grpo"]["max_steps"]) == (3, "--steps", 3)


def test_a_recipe_without_smoke_steps_runs_the_default_few(tmp_path):
    r = write(tmp_path / "plain.yaml", f"defaults: {REPO / 'recipes/grpo.yaml'}\n")
    p = prepared(tmp_path, r)
    assert (p.max_steps, p.steps_from) == (DEFAULT_STEPS, "default")


def test_overrides_apply_after_the_smoke_section(tmp_path):
    p = prepared(tmp_path, overrides=["grpo.max_steps=5", "seed=3"])
    assert (p.max_steps, run_config(p)["seed"]) == (5, 3)


def test_the_run_goes_to_a_fresh_directory_under_out_and_never_resumes(tmp_path):
    cfg = run_config(prepared(tmp_path))
    assert cfg["name"] == "r" and cfg["checkpoint"]["dir"] == str(tmp_path / "out")
    assert (cfg["checkpoint"]["resume"], cfg["checkpoint"]["steps_per_run"]) == (False, None)


def test_the_recipe_checks_keep_the_line_that_wrote_them(tmp_path):
    r = write(tmp_path / "c.yaml", f"defaults: {GRPO}\nchecks:\n  - median(train/token_mult_prob_error) < 1.1\n")
    [c] = prepared(tmp_path, r).checks
    assert (c.text, c.where.rsplit(":", 1)[1]) == ("median(train/token_mult_prob_error) < 1.1", "3")


def test_a_literal_dollar_brace_survives_the_resolved_recipe(tmp_path):
    r = write(tmp_path / "d.yaml", f"defaults: {GRPO}\nlogger:\n  wandb_project: 'cost-\\${{x}}'\n")
    assert run_config(prepared(tmp_path, r))["logger"]["wandb_project"] == "cost-${x}"


def test_a_recipe_that_does_not_load_names_its_line(tmp_path):
    r = write(tmp_path / "bad.yaml", f"defaults: {GRPO}\ngrpo:\n  clip_lo: 0.1\n")
    with pytest.raises(GymvError) as e:
        prepared(tmp_path, r)
    assert e.value.where.endswith("bad.yaml:3") and "clip_lo" in e.value.message


# -- --tiny ------------------------------------------------------------------------------------------------


def test_tiny_drops_a_clusters_node_pins_which_a_laptop_has_none_of(tmp_path):
    p = prepared(tmp_path, GPU_RECIPES[0], tiny=True, overrides=["cluster.placement.training.labels={gymv-node: '1'}"])
    assert run_config(p)["cluster"]["placement"]["training"]["labels"] == {}
    assert any(c.startswith("cluster.placement:") for c in p.tiny_changes)


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_tiny_turns_every_gpu_recipe_into_a_valid_cpu_recipe(tmp_path, recipe):
    p = prepared(tmp_path, recipe, tiny=True)
    cfg = run_config(p)
    from gymv.models.tiny import ARCHES

    assert cfg["model"]["path"] in {f"embedded:{a}" for a in ARCHES}  # the family's stand-in (test below)
    assert (cfg["cluster"]["gpus_per_node"], cfg["cluster"]["num_nodes"], cfg["cluster"]["ray_address"]) == (0, 1, None)
    before = load_recipe(recipe, smoke=True).validated.to_dict()
    own = before["training"]["backend"]
    assert cfg["training"]["backend"] == (own if own in ("fsdp2", "megatron") else "torch")
    assert cfg["generation"]["backend"] == "hf"
    # a size the kept backend runs on a CPU keeps its structure at tiny size (at most 2), the rest become 1;
    # expert parallelism folds over the tensor x context ranks kept (experts whole), up to the tiny 4 experts
    wired = TRAINING_BACKENDS.capabilities(cfg["training"]["backend"]).model_parallel
    want = {k: min(v, 2) if k in wired else 1 for k, v in before["training"]["parallel"].items()}
    if "expert" in wired:
        want["expert"] = min(before["training"]["parallel"]["expert"],
                             max(2, want["tensor"] * want["pipeline"] * want["context"]), 4)
    assert cfg["training"]["parallel"] == want
    assert cfg["refit"]["transport"] not in ("cuda_ipc", "nccl")
    assert cfg["model"]["max_seq_len"] <= 512 and cfg["generation"]["max_new_tokens"] <= 16
    assert cfg["data"]["prepare"]["n_train"] <= 8 and cfg["data"]["train"] is None
    for alias, teacher in (cfg.get("mopd") or {}).get("teachers", {}).items():
        # a megatron teacher stays where the megatron trainer does (the same twin scores)
        kept = before["mopd"]["teachers"][alias]["backend"] == "megatron" == cfg["training"]["backend"]
        tp, ep = ((min(before["mopd"]["teachers"][alias][f"{k}_parallel_size"], 2) for k in ("tensor", "expert"))
                  if kept else (1, 1))
        assert (teacher["path"], teacher["backend"], teacher["placement"]) == (
            cfg["model"]["path"], "megatron" if kept else "torch", "separate" if tp > 1 else "colocated")
        assert (teacher["tensor_parallel_size"], teacher["expert_parallel_size"]) == (tp, ep)


@pytest.mark.parametrize("recipe, backend", [
    ("vlm/vlm_grpo-qwen2.5-vl-7b-1n2g-fsdp2.yaml", "fsdp2"),
    ("llm/grpo-qwen3-1.7b-1n8g-megatron.yaml", "megatron"),
])
def test_tiny_keeps_the_sharded_training_backends_which_run_on_a_cpu(tmp_path, recipe, backend):
    p = prepared(tmp_path, REPO / "recipes" / recipe, tiny=True)
    cfg = run_config(p)
    assert cfg["training"]["backend"] == backend
    assert not any(c.startswith("training.backend") for c in p.tiny_changes)
    assert cfg["training"]["fsdp"]["cpu_offload"] is False


def test_tiny_keeps_a_megatron_teacher_where_the_megatron_trainer_stays(tmp_path):
    pytest.importorskip("megatron.core")
    recipe = REPO / "recipes/vlm/vlm_mopd-nemotron3-super-omni-10n8g-megatron-tp8ep16cp2-async-noncolocated.yaml"
    cfg = run_config(prepared(tmp_path, recipe, tiny=True))
    assert (cfg["training"]["backend"], cfg["mopd"]["teachers"]["self"]["backend"]) == ("megatron", "megatron")


def test_tiny_keeps_the_tensor_parallel_layout_at_size_2_over_gloo_ranks_and_names_the_rest(tmp_path):
    """TP8 x EP16 x CP2 with a TP8 x EP8 teacher: the trainer keeps TP 2 x CP 2 over 4 CPU ranks and EP 4
    folded over them (each expert whole), the teacher's replica 2 ranks of TP 2 x EP 2; what megatron does not run on a CPU
    yet becomes 1, each named as a stand-in."""
    pytest.importorskip("megatron.core")
    recipe = REPO / "recipes/vlm/vlm_mopd-nemotron3-super-omni-10n8g-megatron-tp8ep16cp2-async-noncolocated.yaml"
    p = prepared(tmp_path, recipe, tiny=True)
    cfg = run_config(p)
    wired = TRAINING_BACKENDS.capabilities("megatron").model_parallel
    want = {k: (2 if k in wired else 1) for k in ("tensor", "expert", "context")}
    want["expert"] = 2 * want["context"] if "expert" in wired else 1
    assert {k: cfg["training"]["parallel"][k] for k in want} == want
    assert cfg["cluster"]["cpu_training_ranks"] == want["tensor"] * want["context"]
    teacher = cfg["mopd"]["teachers"]["self"]
    assert (teacher["tensor_parallel_size"], teacher["expert_parallel_size"], teacher["placement"]) == (2, 2, "separate")
    stood_in = " ".join(n for n in p.notes if n.startswith("stand-in for what gymv train cannot run here"))
    for k in ("expert", "context"):
        assert (f"training.parallel.{k}" in stood_in) == (k not in wired)


def test_tiny_runs_megatron_as_torch_when_its_twin_does_not_map_the_stand_in(tmp_path):
    recipe = REPO / "recipes/vlm/vlm_grpo-qwen2.5-vl-7b-1n8g-megatron.yaml"
    p = prepared(tmp_path, recipe, tiny=True, overrides=["model.path=Qwen/Qwen3-VL-8B-Instruct"])
    assert run_config(p)["training"]["backend"] == "torch"
    assert "training.backend: 'megatron' -> 'torch'" in p.tiny_changes


def test_tiny_keeps_what_the_smoke_run_is_meant_to_exercise(tmp_path):
    recipe = REPO / "recipes/vlm/vlm_grpo-qwen2.5-vl-7b-1n8g-megatron-async-1off.yaml"
    before = load_recipe(recipe, smoke=True).validated.to_dict()
    after = run_config(prepared(tmp_path, recipe, tiny=True))
    for key in ("algorithm", "seed"):
        assert after[key] == before[key]
    assert after["grpo"]["async"] == before["grpo"]["async"] and after["grpo"]["async"]["enabled"]
    assert after["grpo"]["importance_sampling"] == before["grpo"]["importance_sampling"]
    assert (after["env"]["name"], after["env"]["max_turns"]) == (before["env"]["name"], before["env"]["max_turns"])
    assert after["generation"]["reset_encoder_cache_after_weight_update"] is True


def test_tiny_turns_overlong_filtering_off_since_a_stand_ins_turns_run_to_the_capped_budget(tmp_path):
    recipe = REPO / "recipes/vlm/vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-fsdp2.yaml"
    assert load_recipe(recipe, smoke=True).validated.grpo.overlong_filtering
    p = prepared(tmp_path, recipe, tiny=True)
    assert run_config(p)["grpo"]["overlong_filtering"] is False
    assert "grpo.overlong_filtering: True -> False" in p.tiny_changes


def test_tiny_drops_a_vllm_teachers_engine_kwargs_with_its_engine(tmp_path):
    recipe = REPO / "recipes/vlm/vlm_mopd-nemotron3-super-omni-10n8g-fsdp2-noncolocated.yaml"
    assert load_recipe(recipe, smoke=True).validated.mopd.teachers["self"].engine_kwargs
    p = prepared(tmp_path, recipe, tiny=True)  # no vLLM build runs the Omni stand-in on a CPU: a torch teacher
    teacher = run_config(p)["mopd"]["teachers"]["self"]
    assert teacher["backend"] == "torch" and teacher["engine_kwargs"] == {}
    assert "mopd.teachers.self.engine_kwargs: {'mamba_ssm_cache_dtype': 'float32'} -> {}" in p.tiny_changes


@pytest.mark.parametrize("recipe, stand_in", [
    ("vlm/vlm_grpo-qwen2.5-vl-7b-1n8g-megatron.yaml", "tiny-qwen2_5vl"),
    ("vlm/vlm_mopd-qwen2.5-vl-3b-2n8g-megatron-noncolocated.yaml", "tiny-qwen2_5vl"),
    ("llm/grpo-qwen3-8b-2n8g-megatron-tp2.yaml", "tiny-qwen3"),
    ("llm/mopd-qwen3-1.7b-1n8g-megatron.yaml", "tiny-qwen3"),
    ("llm/sft-llama3.1-8b-1n8g-fsdp2.yaml", "tiny-llama"),
    ("vlm/vlm_grpo-tinyllava-1n0g-torch.yaml", "tiny-llava"),
    ("vlm/vlm_grpo-nemotron3-nano-omni-30b-a3b-2n8g-fsdp2.yaml", "tiny-nemotron-omni"),
    ("vlm/vlm_mopd-nemotron3-super-omni-10n8g-fsdp2-noncolocated.yaml", "tiny-nemotron-omni"),
])
def test_tiny_stands_in_a_model_of_the_recipes_own_family_for_the_student_and_its_teachers(tmp_path, recipe, stand_in):
    after = run_config(prepared(tmp_path, REPO / "recipes" / recipe, tiny=True))
    assert after["model"]["path"] == f"embedded:{stand_in}"
    teachers = (after.get("mopd") or {}).get("teachers") or {}
    assert all(t["path"] == f"embedded:{stand_in}" for t in teachers.values())


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_the_tiny_stand_in_of_every_gpu_recipe_is_something_gymv_train_runs(tmp_path, recipe):
    from gymv.capabilities import gaps

    p = prepared(tmp_path, recipe, tiny=True)
    assert gaps(load_recipe(p.config_file).validated) == []


def test_tiny_says_it_checks_plumbing_with_stand_ins_and_names_what_it_stood_in_for(tmp_path):
    # a payload dedup turned off is what gymv train cannot run (gymv.capabilities.NOT_WIRED)
    p = prepared(tmp_path, REPO / "recipes/vlm/vlm_mopd-qwen2.5-vl-3b-2n8g-megatron-noncolocated.yaml", tiny=True,
                 overrides=["vision.dedup_payloads=false"])
    assert p.notes[0].startswith("--tiny checks the plumbing with stand-ins")
    stood_in = [n for n in p.notes if n.startswith("stand-in for what gymv train cannot run here")]
    assert any("vision.dedup_payloads" in n for n in stood_in)
    # its vllm generation and Megatron teachers run here (docs/vllm.md, docs/mopd.md)
    assert not any("generation.backend" in n or "mopd.teachers" in n for n in stood_in)


def test_tiny_records_each_change_it_made(tmp_path):
    p = prepared(tmp_path, REPO / "recipes/llm/grpo-qwen3-1.7b-1n8g-megatron.yaml", tiny=True)
    assert "model.path: 'Qwen/Qwen3-1.7B' -> 'embedded:tiny-qwen3'" in p.tiny_changes
    assert "cluster.gpus_per_node: 8 -> 0" in p.tiny_changes


# -- judging a run ---------------------------------------------------------------------------------------------


def judged(tmp_path, checks: tuple[str, ...], outcome: str = "ok", driver_max_steps=None, driver_checks=()):
    """Checks judged against a run directory written by gymv's writers (4 steps, see tests/report_run.py)."""
    from gymv.checks import CheckSource

    run = make_run(tmp_path / "out" / "r", steps=4)
    p = PreparedRun(SmokeTarget(GRPO), "r", "vlm_grpo", 4, "--steps", tmp_path / "out" / "r.recipe.yaml", run,
                    [CheckSource(c, f"x.yaml:{i}") for i, c in enumerate(checks, 1)],
                    [CheckSource(c, f"x.sh:{i}") for i, c in enumerate(driver_checks, 1)], driver_max_steps)
    return evaluate_run(p, TrainOutcome(outcome, 0 if outcome == "ok" else 1, 1.0, None,
                                        None if outcome == "ok" else "boom", tmp_path / "log"))


def test_a_run_whose_checks_all_hold_passes(tmp_path):
    r = judged(tmp_path, ("median(train/token_mult_prob_error) < 1.1", "mean(train/reward_mean, last=3) > 0.2"))
    assert (r.status, r.steps, [c.status for c in r.checks]) == ("PASS", 4, ["pass", "pass"])


def test_one_false_check_fails_the_recipe_and_is_named(tmp_path):
    r = judged(tmp_path, ("median(train/token_mult_prob_error) < 1.1", "mean(train/reward_mean) > 5"))
    assert r.status == "FAIL" and r.reason == "1 of 2 checks failed: mean(train/reward_mean) > 5"


def test_a_check_that_cannot_be_evaluated_fails_the_recipe(tmp_path):
    r = judged(tmp_path, ("mean(train/kl_teacher) < 1",))
    assert r.status == "FAIL" and r.checks[0].status == "error" and "never logged" in r.checks[0].error


def test_a_crashed_run_skips_its_checks_and_keeps_the_reason(tmp_path):
    r = judged(tmp_path, ("mean(train/reward_mean) > 0",), outcome="crash")
    assert (r.status, r.reason, r.checks[0].status) == ("CRASH", "boom", "skip")


def test_driver_checks_count_only_for_a_run_that_reached_max_steps(tmp_path):
    short = judged(tmp_path / "a", (), driver_max_steps=40, driver_checks=("mean(train/reward_mean) > 5",))
    assert (short.status, short.driver_checks[0].status) == ("PASS", "skip")
    assert "step 4 of the driver's MAX_STEPS 40" in short.driver_checks[0].error
    full = judged(tmp_path / "b", (), driver_max_steps=4, driver_checks=("mean(train/reward_mean) > 5",))
    assert (full.status, full.driver_checks[0].status) == ("FAIL", "fail")


# -- JUnit XML ----------------------------------------------------------------------------------------------


def test_junit_has_a_train_case_and_one_case_per_check(tmp_path):
    r = judged(tmp_path, ("median(train/token_mult_prob_error) < 1.1", "mean(train/reward_mean) > 5"))
    root = ET.fromstring(junit_xml([r], "nightly"))
    assert root.tag == "testsuite" and root.get("name") == "gymv smoke nightly"
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("3", "1", "0", "0")
    cases = root.findall("testcase")
    assert [c.get("name") for c in cases] == ["train", "check: median(train/token_mult_prob_error) < 1.1",
                                              "check: mean(train/reward_mean) > 5"]
    assert "mean(train/reward_mean) = 0.25" in cases[2].find("failure").get("message")


def test_junit_stays_well_formed_when_a_check_or_log_holds_control_characters(tmp_path):
    r = judged(tmp_path, ("mean(train/reward_mean) > 5",))
    r.log = "worker said \x1b[31mred\x1b[0m and \x00"
    r.status, r.reason = "CRASH", "bell \x07"
    text = junit_xml([r], "nightly\x01")
    root = ET.fromstring(text)  # raises on ill-formed XML
    assert root.get("name") == "gymv smoke nightly\\x01"
    assert "\\x1b[31mred" in root.find("testcase/error").text


# -- failures never stop the suite ------------------------------------------------------------------------------


def test_a_recipe_that_does_not_load_is_reported_and_the_next_one_still_runs(tmp_path):
    bad = write(tmp_path / "bad.yaml", f"defaults: {GRPO}\ngrpo:\n  clip_lo: 0.1\n")
    worse = write(tmp_path / "worse.yaml", "defaults: nowhere.yaml\n")
    report = run_smoke([str(bad), str(worse)], out_dir=tmp_path / "out")
    assert [r.status for r in report.results] == ["CONFIG", "CONFIG"]
    assert "clip_lo" in report.results[0].reason and "nowhere.yaml" in report.results[1].reason
    assert not report.passed


def test_a_run_that_exceeds_the_timeout_is_stopped_with_its_process_group(tmp_path):
    p = prepared(tmp_path)
    outcome = run_training(p, timeout_s=1.0)
    assert outcome.status == "timeout" and "no result after 1 s" in outcome.reason
    with pytest.raises(ProcessLookupError):
        os.killpg(outcome.pid, 0)


def test_cli_exits_1_with_a_summary_and_writes_junit(tmp_path, gymv):
    bad = write(tmp_path / "bad.yaml", f"defaults: {GRPO}\ngrpo:\n  clip_lo: 0.1\n")
    r = gymv("smoke", bad, "--out", tmp_path / "out", "--junit", tmp_path / "j.xml", cwd=REPO)
    assert r.code == 1
    assert "Smoke summary" in r.stdout and "CONFIG" in r.stdout
    assert ET.parse(tmp_path / "j.xml").getroot().get("errors") == "1"


def test_cli_without_a_target_is_a_usage_error(tmp_path, gymv):
    r = gymv("smoke", "grpo.max_steps=2", cwd=REPO)
    assert r.code == 2 and "no recipe or suite given" in r.stderr


def test_cli_json_lists_every_recipe(tmp_path, gymv):
    bad = write(tmp_path / "bad.yaml", "defaults: nowhere.yaml\n")
    r = gymv("smoke", bad, "--out", tmp_path / "out", "--json", cwd=REPO)
    out = json.loads(r.stdout)
    assert r.code == 1 and out["passed"] is False and out["counts"] == {"CONFIG": 1}
    assert out["results"][0]["recipe"].endswith("bad.yaml")


def test_an_error_about_the_resolved_recipe_also_names_the_recipe_line_that_wrote_the_key(tmp_path):
    p = prepared(tmp_path, REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-async-1off.yaml")
    lines = p.config_file.read_text().splitlines()
    after = next(i for i, text in enumerate(lines) if text.strip() == "async:")
    line = next(i for i, text in enumerate(lines[after:], after + 1) if "enabled: true" in text)
    said = p.explain(f"{p.config_file}:{line}: async GRPO is not implemented")
    assert said == (f"recipes/vlm/vlm_grpo-tinyllava-1n0g-torch-async-1off.yaml:7 (run as {p.config_file}:{line}): "
                    "async GRPO is not implemented")


@pytest.mark.slow
@pytest.mark.parametrize("arch", __import__("gymv.models.tiny", fromlist=["ARCHES"]).ARCHES)
def test_tiny_keeps_megatron_exactly_for_the_stand_ins_its_twin_maps(arch):
    pytest.importorskip("megatron.core")
    from tiny_models import shared_policy

    from gymv.backends.training.megatron import check_maps
    from gymv.smoke.tiny import MEGATRON_STAND_INS

    try:
        check_maps(shared_policy(arch))
        maps = True
    except GymvError:
        maps = False
    assert (arch in MEGATRON_STAND_INS) == maps
