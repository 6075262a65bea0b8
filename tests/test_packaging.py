"""What a plain (non-editable) install ships: data-only folders, and the recipes, exemplars, suite lists and
drivers, so that lint, dry-run and recipe inheritance work away from a source checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gymv.config.exemplars import default_recipes_root, project_recipes_dir, resolve_parent
from gymv.config.loader import load_recipe
from conftest import run_gymv

REPO = Path(__file__).resolve().parents[1]


def test_a_bare_exemplar_name_in_defaults_names_the_shipped_exemplar(tmp_path):
    assert resolve_parent(tmp_path / "mine.yaml", "vlm_grpo") == default_recipes_root().resolve() / "vlm_grpo.yaml"
    assert resolve_parent(tmp_path / "mine.yaml", "grpo.yaml") == default_recipes_root().resolve() / "grpo.yaml"


def test_a_file_beside_the_recipe_wins_over_the_exemplar_of_the_same_name(tmp_path):
    (tmp_path / "grpo.yaml").write_text("algorithm: grpo\n")
    assert resolve_parent(tmp_path / "mine.yaml", "grpo.yaml") == (tmp_path / "grpo.yaml").resolve()


def test_gymv_scheme_names_a_shipped_recipe_file(tmp_path):
    got = resolve_parent(tmp_path / "mine.yaml", "gymv://vlm/vlm_grpo-tinyllava-1n0g-torch.yaml")
    assert got == default_recipes_root().resolve() / "vlm" / "vlm_grpo-tinyllava-1n0g-torch.yaml"


def test_a_users_recipe_outside_the_tree_inherits_an_exemplar_by_name(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("defaults: vlm_grpo\nname: mine\ngrpo:\n  max_steps: 7\n")
    rec = load_recipe(mine)
    assert rec.validated.algorithm == "vlm_grpo" and rec.validated.grpo.max_steps == 7


def test_project_recipes_are_found_from_a_sub_folder_and_from_inside_recipes():
    assert project_recipes_dir(REPO / "recipes" / "vlm") == REPO / "recipes"
    assert project_recipes_dir(REPO / "tests") == REPO / "recipes"


def test_dry_run_from_a_sub_folder_reads_the_projects_suites():
    r = run_gymv("dry-run", "nightly", cwd=REPO / "recipes" / "vlm")
    assert r.code == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("Total GPU hours: ")


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> tuple[Path, str]:
    """gymv built as a wheel and unpacked into its own folder (dependencies come from the test interpreter)."""
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
                           capture_output=True, text=True, check=True)
    wheel = next(out.glob("gymv-*.whl"))
    site = out / "site"
    zipfile.ZipFile(wheel).extractall(site)
    return site, build.stdout + build.stderr


@pytest.mark.slow
def test_building_the_wheel_warns_of_no_undeclared_package(wheel_site):
    _, log = wheel_site
    assert "is absent from the `packages` configuration" not in log


@pytest.mark.slow
def test_the_wheel_ships_templates_exemplars_suites_and_drivers(wheel_site):
    site, _ = wheel_site
    for rel in ("gymv/models/templates/chat.jinja", "gymv/_recipes/vlm_grpo.yaml", "gymv/_recipes/suites/nightly.txt",
                "gymv/_recipes/vlm/vlm_grpo-tinyllava-1n0g-torch.yaml",
                "gymv/_recipes/drivers/vlm/vlm_grpo-tinyllava-1n0g-torch.sh"):
        assert (site / rel).is_file(), rel


@pytest.mark.slow
def test_the_wheel_carries_the_apache_license_text(wheel_site):
    site, _ = wheel_site
    licenses = list(site.glob("gymv-*.dist-info/licenses/LICENSE"))
    assert len(licenses) == 1 and "Apache License" in licenses[0].read_text()


def test_the_repository_has_the_license_its_metadata_names():
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_readme_says_how_to_get_gymv_on_the_path_and_what_a_plain_pip_install_pulls():
    text = (REPO / "README.md").read_text()
    assert ".venv/bin/gymv" in text and "source .venv/bin/activate" in text
    assert "CUDA build" in text and "--index-url https://download.pytorch.org/whl/cpu" in text


def test_contributor_guide_replaces_the_internal_working_agreement():
    assert (REPO / "CONTRIBUTING.md").is_file() and not (REPO / "docs" / "HELPERS.md").exists()


@pytest.mark.slow
def test_an_installed_gymv_lints_and_dry_runs_its_shipped_recipes_from_any_folder(wheel_site, tmp_path):
    site, _ = wheel_site
    env = {"PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    where = run_gymv("--version", env=env, cwd=tmp_path)
    assert where.code == 0
    check = subprocess.run([sys.executable, "-c", "import gymv; print(gymv.__file__)"], cwd=tmp_path,
                           env={**os.environ, **env}, capture_output=True, text=True)
    assert check.stdout.startswith(str(site))
    lint = run_gymv("lint", "--format", "text", env=env, cwd=tmp_path)
    assert lint.code == 0, lint.stdout + lint.stderr
    dry = run_gymv("dry-run", "nightly", env=env, cwd=tmp_path)
    assert dry.code == 0, dry.stderr
    assert dry.stdout.strip().splitlines()[-1].startswith("Total GPU hours: ")
