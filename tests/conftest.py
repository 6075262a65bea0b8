"""Shared fixtures: run the real `gymv` CLI in a subprocess, and find the shared NeMo Gym vectors."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO.parent / "shared" / "vectors"


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_gymv(*args: str, cwd: str | os.PathLike | None = None, env: dict | None = None, timeout: float = 300) -> CliResult:
    """Invoke the installed CLI exactly as a user would (a fresh interpreter, real argv)."""
    full_env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})}
    p = subprocess.run(
        [sys.executable, "-m", "gymv_cli.main", *map(str, args)],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    return CliResult(p.returncode, p.stdout, p.stderr)


@pytest.fixture
def gymv():
    return run_gymv


@pytest.fixture
def vectors() -> Path:
    if not VECTORS.exists():
        pytest.skip(f"shared vectors not found at {VECTORS}")
    return VECTORS


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
