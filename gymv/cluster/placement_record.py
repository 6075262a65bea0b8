"""The placement a run got, as the user reads it at start and as `placement.json` in the run directory: the
cluster's nodes, each role's request and where each of its workers landed (node, address, GPUs)."""

from __future__ import annotations

import json
from pathlib import Path

from gymv.cluster.preflight import Checked
from gymv.cluster.ray_placement import Roster
from gymv.io import atomic_write_text

PLACEMENT_FILE = "placement.json"


def placement_record(checked: Checked | None, roster: Roster, transport: str | None = None) -> dict:
    roles: dict[str, dict] = {role: {"asks": asks, "workers": []} for role, asks in (checked.asks if checked else ())}
    for seat in sorted(roster.seats.values(), key=lambda s: (s.role, s.rank)):
        role = "policy" if "policy" in roles and seat.role in ("training", "generation") else seat.role
        entry = roles.setdefault(role, {"asks": "", "workers": []})
        entry["workers"].append({"worker": seat.name, "node_id": seat.node_id, "address": seat.address,
                                 "gpus": seat.gpus})
    nodes = [{"node_id": n.node_id, "address": n.address, "labels": n.labels,
              "CPU": n.resources.get("CPU", 0), "GPU": n.resources.get("GPU", 0)} for n in (checked.nodes if checked else ())]
    out = {"cluster": checked.cluster if checked else None, "nodes": nodes, "roles": roles}
    if transport:
        out["refit_transport"] = transport
    return out


def placement_lines(record: dict) -> list[str]:
    """One line per role: `training: 2 bundles of {CPU: 1}, SPREAD -> rank 0 on 127.0.0.1 (c52038fa), ...`."""
    lines = []
    for role, r in record["roles"].items():
        on: dict[str, list[str]] = {}
        for w in r["workers"]:
            node = f"{w['address']} ({w['node_id'][:8]})" if w["node_id"] else "?"
            on.setdefault(node, []).append(w["worker"].rsplit(" ", 1)[-1] + (f" [GPU {w['gpus']}]" if w["gpus"] else ""))
        where = "; ".join(f"{node}: {', '.join(ws)}" for node, ws in on.items()) or "no workers"
        lines.append(f"placement: {role} ({r['asks']}) on {where}" if r["asks"] else f"placement: {role} on {where}")
    if record.get("refit_transport"):
        lines.append(f"placement: refit transport {record['refit_transport']}")
    return lines


def write_placement(run_dir: str | Path, record: dict) -> Path:
    path = Path(run_dir) / PLACEMENT_FILE
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    return path
