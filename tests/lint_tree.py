"""Recipe trees for the `gymv lint` tests: the repository's exemplars plus small recipes, drivers and suites."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import REPO

BEGIN = "# ===== BEGIN CONFIG ====="
END = "# ===== END CONFIG ====="


def block(nodes: int = 1, gpus: int = 0, minutes: int = 30) -> str:
    return f"NUM_NODES={nodes}\nGPUS_PER_NODE={gpus}\nSTEPS_PER_RUN=10\nMAX_STEPS=10\nNUM_MINUTES={minutes}\n"


class Tree:
    """A clean recipes/ directory under `base` (no finding), with helpers to plant violations in it.

    Clean content: two CPU recipes (text and VLM GRPO), each with its driver, both in the nightly suite;
    an empty release suite and disabled list; budgets and GPUs per node for both suites.
    """

    def __init__(self, base: Path):
        self.base = base
        self.root = base / "recipes"
        (self.root / "suites").mkdir(parents=True)
        for p in sorted((REPO / "recipes").glob("*.yaml")):
            shutil.copy(p, self.root / p.name)
        self.write("suites/nightly.txt", "# nightly\n")
        self.write("suites/release.txt", "# release\n")
        self.write("suites/disabled.txt", "# disabled, each with a reason\n")
        self.write("suites/budgets.yaml", "nightly: 10\nrelease: 100\n")
        self.write("suites/gpus_per_node.yaml", "nightly: [0, 8]\nrelease: 8\n")
        self.add("llm/grpo-tiny-1n0g-torch.yaml", "# tiny text GRPO on a CPU\ndefaults: ../grpo.yaml\n\nseed: 7\n")
        self.add("vlm/vlm_grpo-tiny-1n0g-torch.yaml", "defaults: ../vlm_grpo.yaml\nseed: 8\n")

    def write(self, rel: str, text: str) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def append(self, rel: str, text: str) -> Path:
        p = self.root / rel
        p.write_text(p.read_text() + text)
        return p

    def driver(self, rel_recipe: str, body: str, after: str = "echo run\n") -> Path:
        rel = "drivers/" + rel_recipe.rsplit(".", 1)[0] + ".sh"
        return self.write(rel, f"#!/usr/bin/env bash\nset -euo pipefail\n\n{BEGIN}\n{body}{END}\n\n{after}")

    def add(self, rel: str, text: str, *, nodes: int = 1, gpus: int = 0, minutes: int = 30,
            suite: str | None = "nightly") -> Path:
        """A recipe, its driver (sized `nodes` x `gpus`) and its suite entry."""
        path = self.write(rel, text)
        self.driver(rel, block(nodes, gpus, minutes))
        if suite:
            self.append(f"suites/{suite}.txt", rel + "\n")
        return path

    def line_of(self, rel: str, needle: str) -> int:
        return next(i for i, line in enumerate((self.root / rel).read_text().splitlines(), 1) if needle in line)

    GPU_RECIPE = "defaults: ../grpo.yaml\ntraining:\n  backend: megatron\ncluster:\n  gpus_per_node: 8\n"
    RUNNABLE_GPU_RECIPE = "defaults: ../grpo.yaml\ntraining:\n  backend: fsdp2\ncluster:\n  gpus_per_node: 8\n"

    def disable(self, rel: str, reason: str = "megatron is not wired into gymv train yet") -> None:
        self.append("suites/disabled.txt", f"{rel}  # {reason}\n")
