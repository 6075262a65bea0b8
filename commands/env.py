"""`gymv env`: serve an environment over HTTP (NeMo Gym compatible), re-score rollouts, list environments."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from gymv.errors import GymvError

app = typer.Typer(
    help="Serve environments over HTTP and re-score rollout files.\n\nExample: gymv env serve circle-click --port 8001",
    no_args_is_help=True,
)


@app.command("list")
def list_envs(json_out: bool = typer.Option(False, "--json", help="Print JSON on stdout.")) -> None:
    """List the environments gymv can serve, verify and generate data for.

    Example: gymv env list
    """
    from gymv.envs import available, get_env
    from gymv_cli.output import console, print_json, table

    rows = []
    for name, source in available().items():
        try:
            env = get_env(name)
            rows.append({"name": name, "source": source, "tools": [t.name for t in env.tool_specs()],
                         "presets": list(env.presets), "description": env.description})
        except GymvError as e:
            rows.append({"name": name, "source": source, "tools": [], "presets": [], "description": f"(broken: {e})"})
    if json_out:
        print_json(rows)
        return
    console.print(table("environments", ["name", "tools", "presets", "source", "description"],
                        [[r["name"], ",".join(r["tools"]) or "-", ",".join(r["presets"]), r["source"], r["description"]]
                         for r in rows]))


@app.command()
def serve(
    name: str = typer.Argument(..., metavar="ENV", help="Environment to serve, e.g. circle-click."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (127.0.0.1: this machine only)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: pick a free one)."),
    max_body_mb: float = typer.Option(64.0, "--max-body-mb", help="Largest accepted request body, in MiB."),
    max_session_mb: float = typer.Option(1024.0, "--max-session-mb", help="Memory for open episodes, in MiB (the least recently used go first)."),
    log_requests: bool = typer.Option(False, "--log-requests", help="Log each request on stderr."),
    max_turns: int = typer.Option(None, "--max-turns", help="Model turns per episode on /step (default: the environment's own)."),
    latency_ms: float = typer.Option(0.0, "--latency-ms", help="Delay every /step and tool call by this much (simulate a slow tool)."),
    read_deadline: float = typer.Option(60.0, "--read-deadline", help="Seconds a request may take to arrive, first byte to last (slower: 408)."),
) -> None:
    """Serve NAME with NeMo Gym's resources-server and gymnasium endpoints until interrupted.

    Endpoints: GET /, GET /describe, POST /seed_session, POST /reset, POST /step, POST /verify,
    POST /aggregate_metrics and POST /<tool> per tool. The first line on stdout is the URL alone
    (e.g. http://127.0.0.1:8001); what is served goes to stderr.

    Example: gymv env serve circle-click --port 8001
             gymv env serve polygon-naming --port 8002 --latency-ms 100   # tools that take 100 ms
    """
    import signal

    from gymv.envs import get_env
    from gymv.envs.server import EnvServer

    if max_body_mb <= 0 or max_session_mb <= 0:
        raise GymvError("--max-body-mb and --max-session-mb must be positive",
                        fix="give sizes in MiB above 0, e.g. --max-body-mb 64")
    if latency_ms < 0:
        raise GymvError("--latency-ms must be >= 0", fix="give 0 (no delay) or more milliseconds")
    if read_deadline <= 0:
        raise GymvError("--read-deadline must be positive", fix="give seconds, e.g. --read-deadline 60")
    env = get_env(name, **({"max_turns": max_turns} if max_turns is not None else {}))
    server = EnvServer(env, host, port, max_body_bytes=int(max_body_mb * 1024 * 1024), log_requests=log_requests,
                        max_session_bytes=int(max_session_mb * 1024 * 1024), step_latency_s=latency_ms / 1000.0,
                        read_deadline=read_deadline)
    print(server.url, flush=True)  # the URL alone, so that `read -r URL` or a script's readline() gets it
    print(f"serving {env.name} on {server.url} (Ctrl-C stops)", file=sys.stderr, flush=True)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()


@app.command()
def verify(
    rollouts: Path = typer.Argument(..., help="Rollout JSONL (NeMo Gym's format: rows plus `response`)."),
    data: Path = typer.Option(None, "--data", help="Rows the rollouts were run on, joined by _ng_task_index."),
    env: str = typer.Option(None, "--env", metavar="ENV", help="Environment to score with (default: from each row)."),
    on_error: str = typer.Option("fail", "--on-error", help="fail: stop at the first unusable line; skip: count it and go on."),
    out: Path = typer.Option(None, "--out", help="Also write the scored rollouts (reward and extras) here."),
    fail_on_mismatch: bool = typer.Option(False, "--fail-on-mismatch", help="Exit 1 when a recorded reward differs."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
) -> None:
    """Re-score rollouts with gymv's verifiers and compare with their recorded rewards.

    Example: gymv env verify rollouts.jsonl --data rows.jsonl
    """
    from gymv.envs.verify import verify_rollouts
    from gymv_cli.output import console, print_json, table

    if on_error not in ("fail", "skip"):
        raise GymvError(f"--on-error must be fail or skip, got {on_error!r}",
                        fix="pass --on-error fail or --on-error skip")
    report = verify_rollouts(rollouts, data=data, env=env, on_error=on_error, out=out)
    if json_out:
        print_json(report.as_dict())
    else:
        rows = [[name, t.rollouts, t.reward_sum / t.rollouts if t.rollouts else None,
                 t.recorded_sum / t.recorded if t.recorded else None, t.mismatches]
                for name, t in sorted(report.by_env.items())]
        rows.append(["all", report.scored, report.mean_reward, report.recorded_mean_reward, len(report.mismatches)])
        console.print(table(f"{rollouts}: {report.lines} rollouts, {report.scored} scored",
                            ["env", "rollouts", "mean reward", "recorded mean", "mismatches"], rows))
        if report.failures:
            console.print(table("reward 0 by reason", ["reason", "count"], sorted(report.failures.items())))
        if report.errors:
            console.print(table(f"unusable lines ({len(report.errors)})", ["line", "error"],
                                [[e["line"], e["error"]] for e in report.errors[:20]]))
        for m in report.mismatches[:20]:
            console.print(f"line {m['line']}: recorded reward {m['recorded']}, gymv {m['gymv']}")
    if fail_on_mismatch and report.mismatches:
        raise typer.Exit(1)
