"""Recipe file names: `<algo>-<model>-<N>n<G>g-<strategy>[-modifiers][.vN]` (VLM algos start with `vlm_`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gymv.config.exemplars import EXEMPLARS
from gymv.findings import Finding
from gymv.config.schema import RecipeBase
from gymv.yamlfile import Origin

STRATEGIES: tuple[str, ...] = ("torch", "fsdp2", "megatron")  # the training backend

_NAME = re.compile(
    r"^(?P<algo>[a-z_]+)-(?P<model>[a-z0-9][a-z0-9.\-]*?)-(?P<nodes>\d+)n(?P<gpus>\d+)g-(?P<strategy>[a-z0-9]+)"
    r"(?P<mods>(?:-[a-z0-9][a-z0-9.]*)*?)(?:\.v(?P<version>\d+))?$"
)
FORMAT = "<algo>-<model>-<N>n<G>g-<strategy>[-modifiers][.vN]"


@dataclass(frozen=True)
class RecipeName:
    algorithm: str
    model: str
    num_nodes: int
    gpus_per_node: int
    strategy: str
    modifiers: tuple[str, ...]
    version: int | None


def parse_recipe_name(name: str) -> RecipeName:
    """Parse a file name or stem; raises ValueError saying what is wrong."""
    stem = name[:-5] if name.endswith(".yaml") else name
    m = _NAME.match(stem)
    if not m:
        raise ValueError(f"{stem!r} does not match {FORMAT}")
    if m["algo"] not in EXEMPLARS:
        raise ValueError(f"{m['algo']!r} is not an algorithm ({', '.join(EXEMPLARS)})")
    if m["strategy"] not in STRATEGIES:
        raise ValueError(f"strategy {m['strategy']!r} is not one of {', '.join(STRATEGIES)}")
    mods = tuple(x for x in m["mods"].split("-") if x)
    return RecipeName(m["algo"], m["model"], int(m["nodes"]), int(m["gpus"]), m["strategy"], mods,
                      int(m["version"]) if m["version"] else None)


def check_recipe_name(path: str | Path, cfg: RecipeBase | None,
                      locate: Callable[[tuple], Origin | None] | None = None) -> list[Finding]:
    """The name must parse and agree with algorithm, cluster size and training backend (with `cfg` None,
    as for a recipe that fails its schema, only the format is checked)."""
    path = Path(path)

    def where(key: str) -> str | None:
        o = locate(tuple(key.split("."))) if locate else None
        return str(o) if o else str(Origin(str(path), None))

    try:
        n = parse_recipe_name(path.name)
    except ValueError as e:
        return [Finding("name.format", f"recipe name {e}", None, str(path), f"rename it to {FORMAT}")]
    if cfg is None:
        return []
    out = []
    expect = [("algorithm", n.algorithm, cfg.algorithm), ("cluster.num_nodes", n.num_nodes, cfg.cluster.num_nodes),
              ("cluster.gpus_per_node", n.gpus_per_node, cfg.cluster.gpus_per_node),
              ("training.backend", n.strategy, cfg.training.backend)]
    for key, in_name, in_cfg in expect:
        if in_name != in_cfg:
            out.append(Finding("name.mismatch", f"the name says {key} {in_name!r}, the recipe has {in_cfg!r}", key,
                               where(key), "rename the file or fix the key"))
    return out
