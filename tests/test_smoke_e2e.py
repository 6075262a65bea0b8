"""`gymv smoke` end to end: real `gymv train` runs of the CPU quickstarts (tiny LLaVA, local Ray), their checks
judged from the metrics they logged; a planted failing check fails its recipe, a crashing recipe is reported
with its reason while the rest of the suite runs, and --tiny runs a GPU (Megatron + vLLM) recipe on the CPU."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

SFT = REPO / "recipes/vlm/vlm_sft-tinyllava-1n0g-torch.yaml"
GRPO = REPO / "recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml"


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """One smoke invocation: a crashing recipe first, then SFT that passes, then GRPO (a sibling recipe inherited)
    whose true checks pass beside a planted false one."""
    base = tmp_path_factory.mktemp("smoke")
    (base / "crash.yaml").write_text(f"defaults: {GRPO}\nenv:\n  name: no-such-env\n")
    (base / "sft.yaml").write_text(f"defaults: {SFT}\nchecks:\n  - min(train/grad_norm) > 0\n"
                                   "  - max(train/loss, last=1) < 100\n")
    (base / "grpo.yaml").write_text(f"defaults: {GRPO}\nchecks:\n  - median(train/token_mult_prob_error) < 1.1\n"
                                    "  - max(train/failed_fraction) == 0\n")
    (base / "planted.yaml").write_text("defaults: grpo.yaml\nchecks:\n  - median(train/token_mult_prob_error) < 1.1\n"
                                       "  - max(train/failed_fraction) == 0\n  - mean(train/reward_mean) > 5\n")
    from conftest import run_gymv

    r = run_gymv("smoke", *(base / f"{n}.yaml" for n in ("crash", "sft", "planted")), "--steps", "1",
                 "--out", base / "runs", "--junit", base / "smoke.xml", cwd=REPO, timeout=1200)
    return base, r


def test_the_suite_exits_1_because_of_the_crash_and_the_planted_check(suite):
    _, r = suite
    assert r.code == 1, r.stderr
    assert "smoke failed: 1 pass, 1 fail, 1 crash of 3 recipes" in " ".join(r.stdout.split())


def test_the_crash_is_reported_with_its_reason_and_the_suite_goes_on(suite):
    base, r = suite
    text = " ".join(r.stdout.split())
    assert "crash.yaml: CRASH" in text and "unknown environment 'no-such-env'" in text
    assert (base / "runs" / "sft" / "metrics.jsonl").is_file()  # the next recipe ran


def test_the_sft_recipe_passes_with_every_check(suite):
    base, r = suite
    text = " ".join(r.stdout.split())
    assert "sft.yaml: PASS, step 1 of 1" in text and "Metric Checks: sft" in text


def test_the_planted_false_check_fails_its_recipe_and_its_true_checks_pass(suite):
    base, r = suite
    text = " ".join(r.stdout.split())
    assert "planted.yaml: FAIL" in text and "Metric Checks: planted" in text
    root = ET.parse(base / "smoke.xml").getroot()
    checks = {c.get("name"): c.find("failure") is None for c in root.iter("testcase")
              if c.get("classname") == "planted" and c.get("name", "").startswith("check: ")}
    assert checks == {"check: median(train/token_mult_prob_error) < 1.1": True,
                      "check: max(train/failed_fraction) == 0": True, "check: mean(train/reward_mean) > 5": False}


def test_junit_records_each_recipe_and_check(suite):
    base, _ = suite
    root = ET.parse(base / "smoke.xml").getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("8", "1", "1", "0")
    failed = [c.get("name") for c in root.iter("testcase") if c.find("failure") is not None]
    assert failed == ["check: mean(train/reward_mean) > 5"]
    crashed = [c.get("classname") for c in root.iter("testcase") if c.find("error") is not None]
    assert crashed == ["crash"]


def test_tiny_runs_a_gpu_recipe_on_the_cpu(tmp_path):
    from conftest import run_gymv

    recipe = REPO / "recipes/vlm/vlm_grpo-qwen2.5-vl-7b-1n8g-megatron.yaml"
    r = run_gymv("smoke", recipe, "--tiny", "--steps", "1", "--out", tmp_path / "runs", "--json", cwd=REPO, timeout=900)
    import json

    out = json.loads(r.stdout)
    [res] = out["results"]
    assert r.code == 0 and res["status"] == "PASS", res
    assert res["steps"] == 1 and "model.path: 'Qwen/Qwen2.5-VL-7B-Instruct' -> 'embedded:tiny-qwen2_5vl'" in res["tiny_changes"]
    assert res["notes"][0].startswith("--tiny checks the plumbing with stand-ins")  # a pass here is not the recipe's
    assert not any(c.startswith("training.backend") for c in res["tiny_changes"])  # megatron itself, on one CPU rank
