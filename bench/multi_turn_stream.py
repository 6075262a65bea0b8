"""Multi-turn rollouts, turn-synchronous against streamed (continuous batching across turns), in one run.

A scripted environment whose episodes last 1 to 4 turns (episode i: 1 + i % 4), each step taking `--step-ms`
of wall time (a tool server's latency); the model samples at temperature 1 with a stop set of one token id in
`--stop-every` (so a turn lasts about that many tokens, at most `--new-tokens`). The same rows, seed and
backend (gymv's static-cache decoder) run twice: turn-synchronous (one `generate` per turn, every environment
steps between turns) and streamed (one `serve` session; an episode's next turn joins the running batch as soon
as its own step is done). Per mode: wall time and episodes/s, decode steps, sampled tokens, row-steps (rows
the decoder ran, summed over its steps: its compute), slot occupancy (sampled tokens / row-steps: the share of
those rows doing useful work), and requests that joined a running batch. Each mode runs once unmeasured first
(graph capture; the decoder keeps up to 16 cache shapes, so measured runs capture little: `capture_s` says).

`--join-every N` adds, per `--sync-every` value below N, a streamed run whose decoder lets N steps pass between
two mid-session refills (`StaticDecodeBackend(join_every=N)`): fewer, larger refills.

Usage: python bench/multi_turn_stream.py --out DIR [--episodes 128] [--join-every 16] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MODEL = dict(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vision_hidden=256, vision_layers=4,
             vision_heads=4, image_size=224, patch_size=14, vocab_size=1024)
SMOKE = dict(MODEL, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vision_hidden=32, vision_layers=1,
             image_size=56)


def scripted_env(step_s: float):
    from gymv.envs.protocol import Environment, Message, ModelTurn, Score, Text

    class Scripted(Environment):
        name = "bench-turns"
        agent_name = "bench_turns_agent"
        max_turns = 4
        concurrent_calls = True  # a server: steps of different episodes overlap

        def step(self, state, turn):
            time.sleep(step_s)
            return super().step(state, turn)

        def follow_up(self, state, turn, results):
            if state.turns >= state.row["turns"]:
                return []
            return [Message("user", [Text(f"Step {state.turns} done. Go on with the next part.")])]

        def score_output(self, row, output):
            return Score(1.0)

        def gold_turn(self, row):
            return ModelTurn(text="ok")

    return Scripted()


def rows(n: int) -> list[tuple[int, dict]]:
    return [(i, {"responses_create_params": {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": f"Task {i}: plan it in {1 + i % 4} parts."}]}]},
        "agent_ref": {"type": "responses_api_agents", "name": "bench_turns_agent"}, "turns": 1 + i % 4})
        for i in range(n)]


class Metered:
    """The backend, summing each call's decode steps, sampled tokens, slot-steps and joins."""

    def __init__(self, inner):
        self.inner = inner
        self.reset()

    SUMMED = ("decode_steps", "new_tokens", "row_steps", "joined", "refill_calls", "repacks", "prefill_rows",
              "capture_s", "encode_s", "prefill_s", "decode_s", "refill_s", "idle_s", "handoff_s")

    def reset(self):
        self.m = dict.fromkeys(self.SUMMED, 0) | {"calls": 0}

    def _add(self):
        t = self.inner.last_timing
        self.m["calls"] += 1
        for k in self.SUMMED:
            self.m[k] += t.get(k, 0)

    def generate(self, requests, params):
        out = self.inner.generate(requests, params)
        self._add()
        return out

    def serve(self, feed, params, on_output, **hints):
        self.inner.serve(feed, params, on_output, **hints)
        self._add()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--stop-every", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--sync-every", default="4,16", help="decode steps between the decoder's host checks (a list: "
                    "both modes run at each)")
    ap.add_argument("--join-every", type=int, default=None, help="also run streamed with the decoder's join_every at "
                    "this many steps (fewer, larger mid-session refills)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no further --sync-every value after this many "
                    "seconds (the results so far are kept)")
    ap.add_argument("--layers", type=int, default=None, help="text layers of the model (default: the 0.8B shape's 16)")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU: checks this script, not speed")
    a = ap.parse_args()
    import torch

    from gymv.backends.generation.base import SamplingParams
    from gymv.backends.generation.static import StaticDecodeBackend
    from gymv.backends.policy import load_policy
    from gymv.models.tiny import init_tiny_llava
    from gymv.rollout import run_rollouts

    model, device = (SMOKE, "cpu") if a.cpu_smoke else (MODEL, "cuda")
    if a.layers:
        model = dict(model, layers=a.layers)
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu-smoke on a CPU")
    a.out.mkdir(parents=True, exist_ok=True)
    t_build = time.perf_counter()
    policy = load_policy(init_tiny_llava(a.out / "model", force=True, **model), device=device,
                         dtype="bfloat16" if device == "cuda" else "float32")
    build_s = time.perf_counter() - t_build
    vision = set(policy.adapter.vision_token_ids)
    stops = tuple(i for i in range(len(policy.tokenizer)) if i % a.stop_every == 0 and i not in vision)
    params = SamplingParams(temperature=1.0, max_new_tokens=a.new_tokens, stop_token_ids=stops, seed=1)
    env = scripted_env(a.step_ms / 1000)
    max_seq_len = 256 + 4 * (a.new_tokens + 32)

    def once(backend: Metered, streamed: bool, n: int) -> dict:
        backend.reset()
        stats: dict = {}
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trajs = run_rollouts(backend, policy.adapter, policy.tokenizer, None, env, rows(n), group_size=1,
                             params=params, max_turns=4, max_rollout_tokens=4 * a.new_tokens, max_seq_len=max_seq_len,
                             streamed=streamed, stats=stats)
        wall = time.perf_counter() - t0
        m = backend.m
        mode = "streamed" if streamed else "turn-synchronous"
        if streamed and backend.join_every:
            mode += f" join {backend.join_every}"
        return {"mode": mode, "sync_every": backend.sync_every,
                "episodes": n, "wall_s": wall, "episodes_per_s": n / wall, "generation_s": stats["generation_s"],
                "turns": sum(t.turns for t in trajs), "truncated": sum(t.truncated for t in trajs),
                "errors": sum(t.error is not None for t in trajs), "backend_calls": m["calls"],
                "slot_occupancy": m["new_tokens"] / max(1, m["row_steps"]), "env_step_s": stats["breakdown/env_step_s"],
                **{k: m[k] for k in Metered.SUMMED if not k.endswith("_s")},
                **{f"backend_{k}": m[k] for k in Metered.SUMMED if k.endswith("_s")}}

    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
              "model": model, "params": sum(p.numel() for p in policy.model.parameters()), "build_s": build_s,
              "new_tokens": a.new_tokens, "stop_every": a.stop_every, "step_ms": a.step_ms, "runs": []}
    print(f"model {result['params'] / 1e6:.0f}M params on {result['device']}, built in {build_s:.1f} s", flush=True)
    for every in (int(x) for x in a.sync_every.split(",")):
        if time.perf_counter() - t_build > a.budget_s:
            result.setdefault("skipped_sync_every", []).append(every)
            print(f"sync_every {every}: skipped, over --budget-s {a.budget_s:.0f}", flush=True)
            continue
        backend = Metered(StaticDecodeBackend.from_policy(policy, compile=False, sync_every=every, max_states=16))
        joins = [None] + ([a.join_every] if a.join_every and a.join_every > every else [])
        for streamed in (False, True):  # unmeasured: captures the graphs each mode's shapes need
            once(backend, streamed, a.episodes)
        for streamed, join in [(False, None)] + [(True, j) for j in joins]:
            backend.inner.join_every = join
            result["runs"].append(once(backend, streamed, a.episodes))
            (a.out / "multi_turn_stream.json").write_text(json.dumps(result, indent=2))
        backend.drop_graphs()
    cols = ("mode", "sync_every", "episodes", "wall_s", "episodes_per_s", "generation_s", "turns", "decode_steps",
            "new_tokens", "row_steps", "slot_occupancy", "joined", "truncated", "errors")
    print(" | ".join(cols))
    for r in result["runs"]:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    split = ("mode", "sync_every", "prefill_rows", "backend_prefill_s", "backend_decode_s", "backend_refill_s",
             "backend_idle_s", "backend_handoff_s", "backend_capture_s", "refill_calls", "repacks")
    print("where the backend's time went (refill_s: the prefills of requests that joined mid-session)")
    print(" | ".join(split))
    for r in result["runs"]:
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in split))
    for sync in (r for r in result["runs"] if r["mode"] == "turn-synchronous"):
        for streamed in (r for r in result["runs"]
                         if r["mode"] != sync["mode"] and r["sync_every"] == sync["sync_every"]):
            print(f"sync_every {sync['sync_every']}: {streamed['mode']} / turn-synchronous "
                  f"{streamed['episodes_per_s'] / sync['episodes_per_s']:.2f}x episodes/s, "
                  f"{streamed['decode_steps'] / max(1, sync['decode_steps']):.2f}x decode steps", flush=True)


if __name__ == "__main__":
    main()
