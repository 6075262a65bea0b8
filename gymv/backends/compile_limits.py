"""dynamo's recompile limits, lifted for code that compiles one function for many shapes.

Past `recompile_limit` (8 by default) dynamo runs a function eagerly from then on, without telling: a decoder
that meets new batch sizes, or the decoder layers that share one compiled code object, would quietly slow down.
"""

from __future__ import annotations


def lift_recompile_limit(at_least: int, accumulated_at_least: int | None = None) -> None:
    """Raise dynamo's per-function recompile limit (and the accumulated one) to at least these values."""
    import torch._dynamo.config as cfg

    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.x
    setattr(cfg, name, max(getattr(cfg, name), at_least))
    if accumulated_at_least is not None and hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, accumulated_at_least)
