"""Package discovery only; all metadata lives in pyproject.toml.

commands/ ships as gymv_cli.commands so that no generic top-level `commands` package is installed.
recipes/ (exemplars, recipes, suite lists, drivers) ships as the data package gymv._recipes, so that an
installed gymv can lint, dry-run and smoke them and a user's recipe can inherit an exemplar by name.
Folders that hold only data (gymv/models/templates) are listed as packages too: setuptools ships package
data only from declared packages.
"""
from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).parent


def data_packages(folder: str, package: str) -> list[str]:
    """`package` and one dotted package per sub-folder of `folder` (they map onto it through package_dir)."""
    root = HERE / folder
    subs = sorted(d.relative_to(root) for d in root.rglob("*") if d.is_dir() and d.name != "__pycache__")
    return [package] + [".".join([package, *d.parts]) for d in subs]


setup(
    packages=find_namespace_packages(include=["gymv", "gymv.*", "gymv_cli", "gymv_cli.*"], exclude=["*.__pycache__"])
    + ["gymv_cli.commands"] + data_packages("recipes", "gymv._recipes"),
    package_dir={"gymv_cli.commands": "commands", "gymv._recipes": "recipes"},
)
