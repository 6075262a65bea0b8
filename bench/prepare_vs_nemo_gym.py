"""Benchmark: `gymv prepare circle-count --n N` against NeMo Gym's own circle_count generator, side by side.

NeMo Gym's generator comes from the public nemo-gym 0.4.0 wheel, downloaded here with pip into a temporary
folder and run from there with PIL (nothing of it is kept or committed). Both run as fresh processes with
NeMo Gym's default parameters (1000x1000 images, radius 30-60, 5-20 circles, 2-4 colors); the wall time
of each includes interpreter start-up. Runs alternate (NeMo Gym, gymv, NeMo Gym, ...) so that load from
other work on the machine falls on both alike; the median of each is compared. Target: gymv >= 4x.

    .venv/bin/python bench/prepare_vs_nemo_gym.py [--n 1000] [--repeats 1] [--wheel nemo_gym-0.4.0-...whl] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

TARGET = 4.0
SCRIPT = "resources_servers/circle_count/generate_data.py"


def fetch_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.12", "--only-binary=:all:",
           "nemo-gym==0.4.0", "-d", str(dest), "-q"]
    subprocess.run(cmd, check=True)
    (wheel,) = dest.glob("nemo_gym-0.4.0-*.whl")
    return wheel


def timed(cmd: list[str], out: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    if not out.exists():
        raise SystemExit(f"{cmd[0]} wrote no output to {out}")
    return elapsed


def first_row_summary(path: Path) -> dict:
    import base64
    import io

    from PIL import Image

    lines = path.read_text().splitlines()
    row = json.loads(lines[0])
    url = row["responses_create_params"]["input"][1]["content"][0]["image_url"]
    with Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as img:
        size = img.size
    return {"rows": len(lines), "keys": sorted(row), "image_size": list(size), "bytes": path.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="rows per run (default 1000)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each generator (median is reported)")
    ap.add_argument("--wheel", type=Path, help="use this nemo-gym 0.4.0 wheel instead of downloading it")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="gymv-bench-") as tmp_s:
        tmp = Path(tmp_s)
        wheel = args.wheel or fetch_wheel(tmp)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SCRIPT, tmp / "nemo")
        script = tmp / "nemo" / SCRIPT
        nemo_out, gymv_out = tmp / "nemo.jsonl", tmp / "gymv.jsonl"
        nemo_cmd = [sys.executable, str(script), "--n", str(args.n), "--out", str(nemo_out)]
        gymv_cmd = [sys.executable, "-m", "gymv_cli.main", "prepare", "circle-count", "--n", str(args.n),
                    "--out", str(gymv_out)]
        nemo_times, gymv_times = [], []
        for _ in range(args.repeats):
            nemo_times.append(timed(nemo_cmd, nemo_out))
            gymv_times.append(timed(gymv_cmd, gymv_out))
        nemo_s, gymv_s = statistics.median(nemo_times), statistics.median(gymv_times)
        result = {
            "n": args.n,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "nemo_gym": {"seconds": round(nemo_s, 3), "rows_per_second": round(args.n / nemo_s, 1),
                         "runs": [round(t, 3) for t in nemo_times], **first_row_summary(nemo_out)},
            "gymv": {"seconds": round(gymv_s, 3), "rows_per_second": round(args.n / gymv_s, 1),
                     "runs": [round(t, 3) for t in gymv_times], **first_row_summary(gymv_out)},
            "ratio": round(nemo_s / gymv_s, 2),
            "target": TARGET,
        }
        result["pass"] = result["ratio"] >= TARGET

    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"circle-count, {args.n} rows, NeMo Gym's default parameters, {result['cores']} cores")
    print(f"{'generator':<10} {'seconds':>8} {'rows/s':>8} {'MB':>6}  image")
    for name in ("nemo_gym", "gymv"):
        r = result[name]
        print(f"{name:<10} {r['seconds']:>8.2f} {r['rows_per_second']:>8.1f} {r['bytes'] / 1e6:>6.1f}  "
              f"{r['image_size'][0]}x{r['image_size'][1]}")
    print(f"ratio (gymv rows/s over NeMo Gym's): {result['ratio']:.2f}x  (target {TARGET:.0f}x: "
          f"{'PASS' if result['pass'] else 'FAIL'})")


if __name__ == "__main__":
    main()
