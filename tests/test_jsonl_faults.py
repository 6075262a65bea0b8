"""JSONL files with bytes that are not UTF-8, or lines nested or sized past the parser's limits: one error
naming the file and line, skippable with --on-error skip, and a report that notes the file and goes on."""

from __future__ import annotations

import json

import pytest

from gymv.envs.verify import verify_rollouts
from gymv.errors import GymvError
from gymv.io import iter_jsonl
from gymv.report import build_report
from gymv.runs.metrics import read_metrics
from conftest import invoke_gymv
from report_run import make_run

GOOD = {"circles": [{"x": 5, "y": 5, "radius": 3, "color": "red"}], "target_color": "red",
        "response": {"output": [{"type": "message", "role": "assistant",
                                 "content": [{"type": "output_text", "text": "\\boxed{1}"}]}]}}


def _file(path, *lines: bytes):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _good() -> bytes:
    return json.dumps(GOOD).encode()


BAD_LINES = {
    "latin-1": (b'{"text": "caf\xe9"}', "not UTF-8 text \\(byte 0xe9"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "huge-int": (b'{"n": ' + b"9" * 5000 + b"}", "malformed JSON line"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, case):
    line, expected = BAD_LINES[case]
    path = _file(tmp_path / "rows.jsonl", _good(), line)
    with pytest.raises(GymvError, match=expected) as e:
        list(iter_jsonl(path))
    assert e.value.where == f"{path}:2"


def test_env_verify_skips_a_non_utf8_line_with_on_error_skip(tmp_path):
    path = _file(tmp_path / "r.jsonl", _good(), b'{"x": "\xff"}', _good())
    report = verify_rollouts(path, env="circle-count", on_error="skip")
    assert (report.lines, report.scored) == (3, 2) and [e["line"] for e in report.errors] == [2]


def test_env_verify_cli_names_the_non_utf8_line(tmp_path):
    path = _file(tmp_path / "r.jsonl", _good(), b'{"x": "\xff"}')
    r = invoke_gymv("env", "verify", str(path), "--env", "circle-count")
    assert r.code == 2 and f"{path}:2: malformed JSON line: not UTF-8" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("reward", ["1.0", None, True, float("nan")])
def test_env_verify_refuses_a_recorded_reward_that_is_not_a_number(tmp_path, reward):
    row = {**GOOD, "reward": reward} if reward is not None else {**GOOD, "reward": {"value": 1}}
    path = _file(tmp_path / "r.jsonl", json.dumps(row).encode())
    with pytest.raises(GymvError, match="r.jsonl:1: the recorded reward .* is not a finite number"):
        verify_rollouts(path, env="circle-count")


def test_a_metrics_file_with_a_non_utf8_line_names_it(tmp_path):
    path = _file(tmp_path / "metrics.jsonl", b'{"step": 1}', b'{"step": 2, "x": "\xfe"}', b'{"step": 3}')
    with pytest.raises(GymvError, match="malformed metrics line: not UTF-8") as e:
        read_metrics(path)
    assert e.value.where == f"{path}:2"


def test_a_report_notes_a_non_utf8_rollout_file_and_goes_on(tmp_path):
    run = make_run(tmp_path / "run", steps=2)
    rollouts = sorted((run / "rollouts").glob("step_*.jsonl"))[0]
    rollouts.write_bytes(rollouts.read_bytes() + b'{"bad": "\xff"}\n')
    result = build_report(run)
    assert any("not UTF-8" in p and rollouts.name in p for p in result.problems)
    assert result.index.exists()


def test_a_malformed_line_offers_only_a_skip_option_the_caller_has(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(GymvError) as plain:
        list(iter_jsonl(p))
    with pytest.raises(GymvError) as offered:
        list(iter_jsonl(p, skip_option="--on-error skip"))
    assert plain.value.where.endswith("rows.jsonl:2") and "--on-error" not in plain.value.fix
    assert offered.value.fix.endswith("or pass --on-error skip")


def test_a_path_with_a_nul_byte_is_an_error_not_a_traceback(tmp_path):
    with pytest.raises(GymvError, match="NUL byte"):
        list(iter_jsonl(tmp_path / "a\0b.jsonl"))
