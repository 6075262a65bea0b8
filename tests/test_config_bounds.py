"""Bounded work on untrusted YAML: alias bombs and deep nesting are refused at once, and a `defaults:`
diamond resolves each file once (linear, not exponential)."""

from __future__ import annotations

import time

import pytest

from gymv.config import load_recipe
from gymv.errors import GymvError
from gymv.runs.run_dir import RunDir


def alias_bomb(key: str = "bomb") -> str:
    """About 500 bytes that stand for 9**10 (3.5 billion) strings."""
    lines = [f"{key}:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _fast(fn, limit_s: float = 5.0):
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        assert time.perf_counter() - t0 < limit_s


def test_an_alias_bomb_in_a_recipe_is_refused_at_once(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: grpo\n" + alias_bomb("env"))
    assert len(recipe.read_bytes()) < 600
    with pytest.raises(GymvError, match=r"r.yaml: the YAML expands to more than \d+ values"):
        _fast(lambda: load_recipe(recipe, validate=False))


def test_an_alias_bomb_in_an_override_is_refused_at_once(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: grpo\n")
    flow = "{a0: &a0 [x, x, x, x, x, x, x, x, x], " + ", ".join(
        f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)) + "}"
    with pytest.raises(GymvError, match="expands to more than"):
        _fast(lambda: load_recipe(recipe, [f"++env.kwargs={flow}"], validate=False))


def test_an_alias_bomb_in_a_runs_config_yaml_is_refused_at_once(tmp_path):
    (tmp_path / "config.yaml").write_text(alias_bomb())
    with pytest.raises(GymvError, match="config.yaml: the YAML expands to more than"):
        _fast(lambda: RunDir(tmp_path).read_config())


def test_a_report_of_a_run_whose_config_is_a_bomb_notes_it_and_goes_on(tmp_path):
    from gymv.report.run import read_run

    (tmp_path / "config.yaml").write_text(alias_bomb())
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n')
    run = read_run(tmp_path)
    assert run.config == {} and any("expands to more than" in p for p in run.problems)


def test_a_few_aliases_still_work(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: grpo\nbase: &b {lr: 0.5}\ntraining:\n  <<: *b\n  eps: 1.0e-8\n")
    assert load_recipe(recipe, validate=False).raw["training"] == {"lr": 0.5, "eps": 1.0e-8}


def test_deep_nesting_is_refused_with_a_clear_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("algorithm: grpo\nx: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(GymvError, match="r.yaml"):
        _fast(lambda: load_recipe(recipe, validate=False))


def _diamond(root, levels: int):
    (root / "l0a.yaml").write_text("algorithm: grpo\n")
    (root / "l0b.yaml").write_text("seed: 1\n")
    for i in range(1, levels + 1):
        for side in "ab":
            (root / f"l{i}{side}.yaml").write_text(f"defaults: [l{i - 1}a.yaml, l{i - 1}b.yaml]\nk{i}{side}: {i}\n")
    return root / f"l{levels}a.yaml"


def test_a_defaults_diamond_resolves_each_file_once(tmp_path):
    top = _diamond(tmp_path, 30)  # 2**30 paths to the bottom files
    t0 = time.perf_counter()
    loaded = load_recipe(top, validate=False)
    assert time.perf_counter() - t0 < 5
    assert loaded.raw["algorithm"] == "grpo" and loaded.raw["k29b"] == 29
    assert len(loaded.chain) == len(set(loaded.chain)) == 61


def test_a_defaults_chain_deeper_than_the_cap_is_an_error(tmp_path):
    with pytest.raises(GymvError, match=r"`defaults` chain deeper than \d+ files"):
        load_recipe(_diamond(tmp_path, 80), validate=False)


def _flat_recipe(root, n: int):
    path = root / "recipes" / "llm" / f"grpo-keys{n}-1n0g-torch.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("defaults: grpo\n" + "".join(f"k{i}: {i}\n" for i in range(n)) + "grpo:\n"
                    + "".join(f"  g{i}: {i}\n" for i in range(n)))
    return path


@pytest.mark.slow
def test_lint_time_grows_linearly_with_the_number_of_keys(tmp_path):
    """CPU seconds at 8x the keys, against 1x, in one run: ~8 when linear, ~64 when quadratic (as merging was:
    every key scanned every origin)."""
    from gymv.config.lint import lint_paths

    small, large = _flat_recipe(tmp_path, 250), _flat_recipe(tmp_path, 2000)
    lint_paths([small])  # imports and the exemplar's own load, out of the timings

    def cpu(path) -> float:
        t0 = time.process_time()
        report = lint_paths([path])
        assert report.errors >= 2  # the unknown keys are reported: the whole file was read
        return time.process_time() - t0

    times = {small: [], large: []}
    for _ in range(3):
        for p in (small, large):
            times[p].append(cpu(p))
    ratio = min(times[large]) / min(times[small])
    assert ratio < 24, f"8x the keys took {ratio:.0f}x the CPU time"

