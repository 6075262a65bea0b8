"""Suite lists, budgets and `gymv dry-run`: what is counted, how it is shown, and how bad input fails."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from gymv.errors import GymvError
from gymv.recipes.gpu_hours import format_gpu_hours, format_hours, plan
from gymv.recipes.suites import (
    driver_for_recipe,
    entries_missing_reason,
    load_budgets,
    load_suite,
    recipe_for_driver,
)
from conftest import REPO

BEGIN = "# ===== BEGIN CONFIG ====="
END = "# ===== END CONFIG ====="


def sizing(nodes: int = 1, gpus: int = 8, steps: int = 10, max_steps: int = 10, minutes: int = 60) -> str:
    return f"NUM_NODES={nodes}\nGPUS_PER_NODE={gpus}\nSTEPS_PER_RUN={steps}\nMAX_STEPS={max_steps}\nNUM_MINUTES={minutes}\n"


def make_recipes(root: Path, recipes: dict[str, str], suites: dict[str, str], budgets: str | None = None) -> Path:
    """A recipes dir: `recipes` maps 'llm/x.yaml' to its driver's CONFIG body; suites map name -> file text."""
    rd = root / "recipes"
    for rel, block in recipes.items():
        (rd / rel).parent.mkdir(parents=True, exist_ok=True)
        (rd / rel).write_text("defaults: ../grpo_base.yaml\n")
        drv = driver_for_recipe(rd, rel)
        drv.parent.mkdir(parents=True, exist_ok=True)
        drv.write_text(f"#!/bin/bash\n{BEGIN}\n{block}{END}\necho run\n")
    (rd / "suites").mkdir(parents=True, exist_ok=True)
    for name, text in suites.items():
        (rd / "suites" / f"{name}.txt").write_text(text)
    if budgets is not None:
        (rd / "suites" / "budgets.yaml").write_text(budgets)
    return rd


def own_stderr(r) -> list[str]:
    """stderr without warnings about other, unrelated command plugins failing to load."""
    return [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("warning: command plugin")]


@pytest.fixture
def repo(tmp_path) -> Path:
    """nightly: 2 drivers (8 + 16 GPU-hours), release: 1 (32), disabled: 1 (never counted by default)."""
    make_recipes(
        tmp_path,
        {
            "llm/a-1n8g.yaml": sizing(minutes=60),
            "vlm/deep/b-2n8g.yaml": sizing(nodes=2, minutes=60),
            "llm/c-4n8g.yaml": sizing(nodes=4, minutes=60),
            "llm/off-1n8g.yaml": sizing(minutes=600),
        },
        {
            "nightly": "# nightly suite\nllm/a-1n8g.yaml\nrecipes/vlm/deep/b-2n8g.yaml  # accepts the recipes/ prefix\n",
            "release": "llm/c-4n8g.yaml\n",
            "disabled": "llm/off-1n8g.yaml  # flaky on H100, see issue 7\n",
        },
        budgets="nightly: 20\nrelease: 30\n",
    )
    return tmp_path


# -- suites, budgets, mapping -----------------------------------------------------------------------


def test_suite_entries_are_normalised_relative_to_the_recipes_dir(repo):
    s = load_suite(repo / "recipes/suites/nightly.txt")
    assert [(e.recipe, e.line) for e in s.entries] == [("llm/a-1n8g.yaml", 2), ("vlm/deep/b-2n8g.yaml", 3)]


def test_disabled_entries_expose_their_reason_comment(repo):
    [e] = load_suite(repo / "recipes/suites/disabled.txt").entries
    assert e.reason == "flaky on H100, see issue 7"


def test_disabled_entry_without_reason_is_reported_as_data(tmp_path):
    p = tmp_path / "recipes/suites/disabled.txt"
    p.parent.mkdir(parents=True)
    p.write_text("llm/x.yaml  # broken since v2\nllm/y.yaml\n")
    missing = entries_missing_reason(load_suite(p))
    assert [(e.recipe, e.where) for e in missing] == [("llm/y.yaml", f"{p}:2")]


def test_suite_line_with_two_paths_is_an_error(tmp_path):
    p = tmp_path / "recipes/suites/nightly.txt"
    p.parent.mkdir(parents=True)
    p.write_text("llm/x.yaml llm/y.yaml\n")
    with pytest.raises(GymvError) as info:
        load_suite(p)
    assert info.value.where == f"{p}:1"


def test_budgets_are_read_as_exact_gpu_hours(repo):
    assert load_budgets(repo / "recipes") == {"nightly": Fraction(20), "release": Fraction(30)}


def test_non_numeric_budget_is_an_error(tmp_path):
    rd = make_recipes(tmp_path, {}, {}, budgets="nightly: lots\n")
    with pytest.raises(GymvError) as info:
        load_budgets(rd)
    assert "nightly" in info.value.message


def test_recipe_maps_to_driver_with_the_same_relative_name_and_back(tmp_path):
    rd = tmp_path / "recipes"
    drv = driver_for_recipe(rd, "vlm/x/y-1n8g.yaml")
    assert drv == rd / "drivers/vlm/x/y-1n8g.sh"
    assert recipe_for_driver(rd, drv) == "vlm/x/y-1n8g.yaml"


# -- planning (engine) -------------------------------------------------------------------------------


def test_no_targets_means_every_suite_except_disabled(repo):
    r = plan((), repo / "recipes")
    assert [g.suite for g in r.groups] == ["nightly", "release"]
    assert r.total_gpu_minutes == (8 + 16 + 32) * 60


def test_directory_target_recurses_into_subdirectories(repo):
    r = plan([repo / "recipes/drivers/vlm"], repo / "recipes")
    assert [d.config.path.name for d in r.groups[0].drivers] == ["b-2n8g.sh"]


def test_recipe_and_driver_of_the_same_pair_count_once(repo):
    rd = repo / "recipes"
    r = plan([rd / "llm/a-1n8g.yaml", rd / "drivers/llm/a-1n8g.sh"], rd)
    assert len(r.groups[0].drivers) == 1


def test_suite_over_and_within_budget(repo):
    r = plan(["nightly", "release"], repo / "recipes")
    nightly, release = r.groups
    assert (nightly.gpu_hours, nightly.over_budget) == (24, True)
    assert (release.gpu_hours, release.over_budget) == (32, True)
    r2 = plan(["nightly"], repo / "recipes")
    assert r2.groups[0].budget == 20


def test_suite_at_exactly_its_budget_is_not_over(tmp_path):
    rd = make_recipes(tmp_path, {"llm/a.yaml": sizing(minutes=60)}, {"nightly": "llm/a.yaml\n"}, budgets="nightly: 8\n")
    assert plan(["nightly"], rd).groups[0].over_budget is False


def test_suite_entry_without_driver_is_an_error_at_its_line(repo):
    rd = repo / "recipes"
    (rd / "drivers/llm/a-1n8g.sh").unlink()
    with pytest.raises(GymvError) as info:
        plan(["nightly"], rd)
    assert info.value.where == f"{rd / 'suites/nightly.txt'}:2"
    assert "no driver" in info.value.message


def test_recipe_listed_twice_in_a_suite_is_an_error(repo):
    rd = repo / "recipes"
    (rd / "suites/release.txt").write_text("llm/c-4n8g.yaml\nrecipes/llm/c-4n8g.yaml\n")
    with pytest.raises(GymvError) as info:
        plan(["release"], rd)
    assert info.value.where.endswith("release.txt:2")


def test_display_rounds_half_up_to_two_decimals_from_exact_values():
    assert format_gpu_hours(80) == "1.33"  # 80 GPU-minutes = 1.333... h
    assert format_gpu_hours(100) == "1.67"
    assert format_hours(Fraction(1, 8)) == "0.13"  # 0.125, half up
    assert format_gpu_hours(3 * 40) == "2.00"  # three drivers of 0.666... h sum exactly to 2


# -- the CLI ------------------------------------------------------------------------------------------


def test_cli_last_line_is_the_total(gymv, repo):
    r = gymv("dry-run", cwd=repo)
    assert r.code == 0, r.stderr
    assert r.stdout.rstrip("\n").splitlines()[-1] == "Total GPU hours: 56.00"


def test_cli_shows_a_table_per_suite_with_budget_marks(gymv, repo):
    (repo / "recipes/suites/budgets.yaml").write_text("nightly: 100\nrelease: 30\n")
    r = gymv("dry-run", cwd=repo)
    assert "suite nightly" in r.stdout and "suite release" in r.stdout
    within = next(line for line in r.stdout.splitlines() if "within budget" in line)
    over = next(line for line in r.stdout.splitlines() if "OVER BUDGET" in line)
    assert "100.00" in within and "30.00" in over
    assert "off-1n8g" not in r.stdout


def test_cli_suite_name_selects_one_suite(gymv, repo):
    r = gymv("dry-run", "release", cwd=repo)
    assert "suite release" in r.stdout and "suite nightly" not in r.stdout
    assert r.stdout.splitlines()[-1] == "Total GPU hours: 32.00"


def test_cli_json_shape(gymv, repo):
    r = gymv("dry-run", "--json", cwd=repo)
    assert r.code == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {"recipes_dir", "recipes_source", "rounding", "suites", "total_gpu_minutes", "total_gpu_hours",
                         "not_costed", "warnings"}
    assert (data["recipes_dir"], data["recipes_source"], data["not_costed"]) == ("recipes", "this project's", [])
    nightly = data["suites"][0]
    assert (nightly["suite"], nightly["budget_gpu_hours"], nightly["gpu_hours"], nightly["over_budget"]) == ("nightly", 20.0, 24.0, True)
    d = nightly["drivers"][0]
    assert d["recipe"] == "llm/a-1n8g.yaml" and d["driver"].endswith("drivers/llm/a-1n8g.sh")
    assert (d["num_nodes"], d["gpus_per_node"], d["num_runs"], d["num_minutes"], d["gpu_minutes"], d["gpu_hours"]) == (1, 8, 1, 60, 480, 8.0)
    assert (data["total_gpu_minutes"], data["total_gpu_hours"]) == (3360, 56.0)


def test_cli_recipes_dir_option(gymv, repo, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("cwd")
    r = gymv("dry-run", "--recipes-dir", repo / "recipes", "release", cwd=elsewhere)
    assert r.code == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "Total GPU hours: 32.00"


def test_cli_paths_in_subdirectories_are_found(gymv, repo):
    r = gymv("dry-run", "recipes/drivers", cwd=repo)
    assert r.code == 0, r.stderr
    assert "b-2n8g.sh" in r.stdout and "off-1n8g.sh" in r.stdout
    assert r.stdout.splitlines()[-1] == "Total GPU hours: 136.00"


def test_cli_drivers_do_not_leak_values_into_each_other(gymv, tmp_path):
    make_recipes(tmp_path, {
        "llm/a.yaml": sizing(gpus=2, minutes=60) + "NUM_RUNS=5\n",
        "llm/b.yaml": "NUM_NODES=1\nSTEPS_PER_RUN=10\nMAX_STEPS=10\nNUM_MINUTES=60\n",
    }, {"nightly": "llm/a.yaml\nllm/b.yaml\n"})
    data = json.loads(gymv("dry-run", "--json", cwd=tmp_path).stdout)
    b = data["suites"][0]["drivers"][1]
    assert (b["gpus_per_node"], b["num_runs"], b["gpu_hours"]) == (8, 1, 8.0)


def test_cli_wrapper_counts_once_with_the_wrappers_value(gymv, tmp_path):
    rd = make_recipes(tmp_path, {"llm/base.yaml": 'NUM_NODES="${NUM_NODES:-10}"\nSTEPS_PER_RUN=10\nMAX_STEPS=10\nNUM_MINUTES=60\n'},
                      {"nightly": "llm/wrap.yaml\n"})
    (rd / "llm/wrap.yaml").write_text("defaults: base.yaml\n")
    (rd / "drivers/llm/wrap.sh").write_text(f'#!/bin/bash\n{BEGIN}\nexport NUM_NODES=2\n{END}\nexec "$(dirname "$0")/base.sh" "$@"\n')
    r = gymv("dry-run", "--json", cwd=tmp_path)
    [d] = json.loads(r.stdout)["suites"][0]["drivers"]
    assert (d["num_nodes"], d["gpu_hours"], d["exec_chain"]) == (2, 16.0, [str(Path("recipes/drivers/llm/base.sh"))])


def test_cli_bad_driver_is_one_line_naming_file_and_line_exit_2(gymv, repo):
    (repo / "recipes/drivers/llm/a-1n8g.sh").write_text(f"#!/bin/bash\n{BEGIN}\n{sizing()}HOST=$(hostname)\n{END}\n")
    r = gymv("dry-run", cwd=repo)
    assert r.code == 2
    assert "Traceback" not in r.stderr
    [line] = own_stderr(r)
    assert line.startswith("error: recipes/drivers/llm/a-1n8g.sh:8: command substitution")


BAD_BLOCKS = {
    "no END marker": (f"{BEGIN}\n" + sizing(), 2, "no END marker"),
    "no block": (sizing(), 1, "no CONFIG block"),
    "command substitution": (f"{BEGIN}\n{sizing()}H=$(hostname)\n{END}\n", 8, "command substitution"),
    "backticks": (f"{BEGIN}\n{sizing()}H=`hostname`\n{END}\n", 8, "backticks"),
    "unknown variable": (f"{BEGIN}\n{sizing()}X=$NOPE\n{END}\n", 8, "unknown variable"),
    "malformed arithmetic": (f"{BEGIN}\n{sizing()}X=$(( 2 * ))\n{END}\n", 8, "malformed arithmetic"),
    "division by zero": (f"{BEGIN}\n{sizing()}X=$(( 2 / 0 ))\n{END}\n", 8, "division by zero"),
    "missing key": (f"{BEGIN}\nNUM_NODES=1\n{END}\n", 2, "does not set"),
    "non-integer": (f"{BEGIN}\n{sizing().replace('NUM_MINUTES=60', 'NUM_MINUTES=1.5')}{END}\n", 7, "not an integer"),
}


@pytest.mark.parametrize("case", list(BAD_BLOCKS))
def test_cli_each_bad_driver_exits_2_with_one_line_naming_file_and_line(gymv, repo, case):
    body, line, message = BAD_BLOCKS[case]
    (repo / "recipes/drivers/llm/c-4n8g.sh").write_text("#!/bin/bash\n" + body)
    r = gymv("dry-run", "release", cwd=repo)
    assert r.code == 2
    assert "Traceback" not in r.stderr
    [err] = own_stderr(r)
    assert err.startswith(f"error: recipes/drivers/llm/c-4n8g.sh:{line}: ") and message in err


def test_cli_unknown_suite_is_one_line_listing_suites_exit_2(gymv, repo):
    r = gymv("dry-run", "nightlyy", cwd=repo)
    assert r.code == 2
    [line] = own_stderr(r)
    assert "nightlyy" in line and "nightly, release" in line


def test_cli_fail_over_budget_exits_1_but_still_prints_the_total(gymv, repo):
    r = gymv("dry-run", "--fail-over-budget", "nightly", cwd=repo)
    assert r.code == 1
    assert r.stdout.splitlines()[-1] == "Total GPU hours: 24.00"


def test_cli_help_has_an_example_and_the_rounding_rule(gymv):
    out = gymv("dry-run", "--help").stdout
    assert "Example: gymv dry-run" in out
    assert "half up, to 2 decimals" in out


def test_repository_suites_dry_run_cleanly(gymv):
    if not (REPO / "recipes" / "suites").is_dir():
        pytest.skip("the repository has no recipes/suites yet")
    r = gymv("dry-run", "--recipes-dir", REPO / "recipes", cwd=REPO)
    assert r.code == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("Total GPU hours: ")


# -- NeMo RL's own suite lists (driver .sh paths from the repository root) ---------------------------------


def nemo_rl_driver(path: Path, block: str, after: str = "") -> None:
    """A driver written the way NeMo RL writes them: helpers sourced before the block, the launch after it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('#!/bin/bash\nSCRIPT_DIR=$( cd -- "$( dirname -- "${BASH_SOURCE[0]}" )" &> /dev/null && pwd)\n'
                    f'source $SCRIPT_DIR/common.env\n\n{BEGIN}\n{block}{END}\n\nexit_if_max_steps_reached\n{after}'
                    'uv run examples/run_grpo_math.py --config $CONFIG_PATH\n')


@pytest.fixture
def nemo_rl(tmp_path) -> Path:
    """A NeMo RL checkout: tests/test_suites/nightly.txt lists two drivers, one a wrapper that execs the other."""
    suites = tmp_path / "tests" / "test_suites"
    nemo_rl_driver(suites / "llm" / "grpo-a-1n8g.sh",
                   'NUM_NODES="${NUM_NODES:-4}"\nSTEPS_PER_RUN=50\nMAX_STEPS=100\n'
                   "NUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))  # Round up\nNUM_MINUTES=60\n")
    nemo_rl_driver(suites / "llm" / "grpo-a-1n8g-long.sh",
                   "NUM_NODES=1\nSTEPS_PER_RUN=50\nMAX_STEPS=100\nNUM_RUNS=$(( (MAX_STEPS + STEPS_PER_RUN - 1) / STEPS_PER_RUN ))\n"
                   "NUM_MINUTES=30\n", after='exec "$SCRIPT_DIR/grpo-a-1n8g.sh" "$@"\n')
    (suites / "nightly.txt").write_text("# GRPO\ntests/test_suites/llm/grpo-a-1n8g.sh\n\n"
                                        "# long run\ntests/test_suites/llm/grpo-a-1n8g-long.sh\n")
    return tmp_path


def test_a_nemo_rl_suite_list_of_driver_paths_is_costed(nemo_rl):
    result = plan([nemo_rl / "tests/test_suites/nightly.txt"])
    [group] = result.groups
    assert group.suite == "nightly"
    assert [d.config.path.name for d in group.drivers] == ["grpo-a-1n8g.sh", "grpo-a-1n8g-long.sh"]
    assert [d.gpu_minutes for d in group.drivers] == [2 * 4 * 8 * 60, 2 * 1 * 8 * 30]


def test_a_wrapper_driver_counts_what_its_own_config_block_allocates_and_warns_of_the_mismatch(nemo_rl):
    result = plan([nemo_rl / "tests/test_suites/nightly.txt"])
    wrapper = result.groups[0].drivers[1].config
    assert wrapper.num_nodes == 4 and wrapper.allocation("NUM_NODES") == 1  # runs with 4, the launcher allocates 1
    assert wrapper.gpu_hours == Fraction(2 * 1 * 8 * 30, 60)
    warnings = result.warnings()
    assert any("NUM_NODES='1' does not reach the driver it execs" in w and "GPU-hours count the wrapper's value" in w
               for w in warnings), warnings


def test_cli_reads_a_nemo_rl_suite_list_from_a_sub_folder(gymv, nemo_rl):
    r = gymv("dry-run", "test_suites/nightly.txt", cwd=nemo_rl / "tests")
    assert r.code == 0, r.stderr
    assert r.stdout.rstrip("\n").splitlines()[-1] == "Total GPU hours: 72.00"  # 64 + 8
    assert "grpo-a-1n8g-long.sh" in r.stdout and "not a recipe" not in r.stderr
    assert "BUDGET" not in r.stdout  # gymv's own budgets.yaml speaks of gymv's suites, not of this list


def test_cli_json_shows_the_allocated_sizing_and_what_the_execd_driver_runs_with(gymv, nemo_rl):
    r = gymv("dry-run", "tests/test_suites/nightly.txt", "--json", cwd=nemo_rl)
    wrapper = json.loads(r.stdout)["suites"][0]["drivers"][1]
    assert (wrapper["num_nodes"], wrapper["num_minutes"], wrapper["gpu_hours"]) == (1, 30, 8.0)
    assert wrapper["runs_with"] == {"num_nodes": 4, "num_minutes": 60}


def test_a_missing_driver_in_a_nemo_rl_list_names_its_line(nemo_rl):
    suite = nemo_rl / "tests/test_suites/nightly.txt"
    suite.write_text(suite.read_text() + "tests/test_suites/llm/gone.sh\n")
    with pytest.raises(GymvError) as e:
        plan([suite])
    assert e.value.where == f"{suite}:6" and "gone.sh not found" in e.value.message


def test_cli_first_line_names_the_recipes_it_read(gymv, repo, tmp_path_factory):
    assert gymv("dry-run", "release", cwd=repo).stdout.splitlines()[0] == "recipes: recipes (this project's)"
    elsewhere = gymv("dry-run", "release", cwd=tmp_path_factory.mktemp("no-project")).stdout.splitlines()[0]
    assert elsewhere.startswith("recipes: ") and "(the recipes shipped with gymv: no project recipes/ here)" in elsewhere


def test_keep_going_totals_what_it_could_cost_and_names_the_rest(gymv, repo):
    broken = repo / "recipes/drivers/llm/a-1n8g.sh"
    broken.write_text(broken.read_text().replace("STEPS_PER_RUN=10\n", ""))
    stopped = gymv("dry-run", "nightly", cwd=repo)
    assert stopped.code != 0 and "Total GPU hours" not in stopped.stdout
    r = gymv("dry-run", "nightly", "--keep-going", cwd=repo)
    assert r.code == 1
    lines = r.stdout.rstrip("\n").splitlines()
    assert lines[-1] == "Total GPU hours: 16.00"  # b-2n8g alone
    assert lines[-3] == "Not costed (1; the total leaves them out):" and "a-1n8g.sh" in lines[-2] and "STEPS_PER_RUN" in lines[-2]
    data = json.loads(gymv("dry-run", "nightly", "--keep-going", "--json", cwd=repo).stdout)
    assert data["total_gpu_hours"] == 16.0 and "a-1n8g.sh" in data["not_costed"][0]["error"]
