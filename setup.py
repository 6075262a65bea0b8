"""Package discovery only; all metadata lives in pyproject.toml.

commands/ ships as gymv_cli.commands so that no generic top-level `commands` package is installed.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["gymv", "gymv.*", "gymv_cli", "gymv_cli.*"]) + ["gymv_cli.commands"],
    package_dir={"gymv_cli.commands": "commands"},
)
