"""Triton kernels run on a CPU: a child process started with TRITON_INTERPRET=1 (triton picks its interpreter
when it is first imported, so not in the test process), whose last stdout line is a JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_interpreted(child: str, timeout_s: float = 300) -> dict:
    """The JSON the Python source `child` prints last, run under triton's CPU interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=timeout_s)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def assert_within(errors: dict, tolerance: float, case: str = "") -> None:
    """Every relative error a child reported for `case` is there (None: shapes or dtypes differed) and below
    `tolerance`."""
    assert errors and all(e is not None and e < tolerance for e in errors.values()), (case, errors)
