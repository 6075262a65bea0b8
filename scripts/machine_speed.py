"""How fast this machine runs the kind of work the test suite does, in seconds of a fixed workload.

The suite's budgets (scripts/test.sh) are wall times on 2 cores, but the same 2-core machine has been measured
at up to twice its usual time for the same tests, idle, from one hour to the next. scripts/test.sh runs this
before the main suite and, where the machine is slower than the reference the budgets were set at, scales the
limits by that much (never tightens them), printing the factor beside the stage times.

The workload is what the suite spends its time on: fresh Python processes importing torch and transformers
(every Ray actor and CLI test pays it) and small torch ops on one thread (the tiny models). Each part is timed
three times and its fastest run kept, so a moment of load does not count as the machine's speed.
Prints the seconds (the sum of the two parts' fastest runs).
"""

from __future__ import annotations

import subprocess
import sys
import time

IMPORTS = "import torch, transformers; from transformers import LlavaForConditionalGeneration"


def imports_s() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, capture_output=True)
    return time.perf_counter() - t0


def small_ops_s() -> float:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 384), torch.nn.SiLU(), torch.nn.Linear(384, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 128)
    t0 = time.perf_counter()
    for _ in range(300):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return time.perf_counter() - t0


def main() -> None:
    seconds = min(imports_s() for _ in range(3)) + min(small_ops_s() for _ in range(3))
    print(f"{seconds:.2f}")


if __name__ == "__main__":
    main()
