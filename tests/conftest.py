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
def tmpfs(tmp_path):
    """tmpfs(size) -> the folder of a real tmpfs of that size ("4m"): a disk that fills up or turns read-only
    for real. Mounting needs root; elsewhere the test is skipped. Unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


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
