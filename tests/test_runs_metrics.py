"""metrics.jsonl: append + fsync per step, tolerant reads of a truncated last line, rewind on resume."""

import json

import pytest
import torch

from gymv.errors import GymvError
from gymv.runs.metrics import MetricsLog, read_metrics, truncate_metrics_after


def test_each_log_call_appends_one_row_with_step_and_wall_time(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLog(path) as log:
        log.log(1, {"train/loss": 0.5}, wall_time=100.0)
        log.log(2, {"train/loss": 0.25}, wall_time=101.0)
    assert path.read_text().splitlines() == [
        '{"step":1,"wall_time":100.0,"train/loss":0.5}',
        '{"step":2,"wall_time":101.0,"train/loss":0.25}',
    ]


def test_a_row_is_on_disk_before_log_returns(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    log.log(1, {"x": 1})
    assert read_metrics(tmp_path / "m.jsonl")[0]["x"] == 1  # read while the writer is still open
    log.close()


def test_tensors_become_numbers_and_non_finite_values_become_null(tmp_path):
    with MetricsLog(tmp_path / "m.jsonl") as log:
        log.log(1, {"a": torch.tensor(2.5), "b": float("nan"), "c": float("inf")})
    row = read_metrics(tmp_path / "m.jsonl")[0]
    assert (row["a"], row["b"], row["c"]) == (2.5, None, None)


def test_reserved_names_are_refused(tmp_path):
    with MetricsLog(tmp_path / "m.jsonl") as log, pytest.raises(GymvError, match="reserved"):
        log.log(1, {"step": 3})


def test_reading_skips_a_truncated_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1,"x":1}\n{"step":2,"x"')
    assert [r["step"] for r in read_metrics(path)] == [1]


def test_a_broken_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1}\n{"step":\n{"step":3}\n')
    with pytest.raises(GymvError, match=r"m\.jsonl:2"):
        read_metrics(path)


def test_a_new_writer_cuts_a_truncated_tail_before_appending(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1}\n{"step":2,"x"')
    with MetricsLog(path) as log:
        log.log(2, {"x": 2}, wall_time=0.0)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_truncate_after_keeps_rows_up_to_the_step(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        for step in range(5):
            log.log(step, {"x": step})
    assert truncate_metrics_after(path, 2) == 3
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]


@pytest.mark.parametrize("row,why", [
    ({"step": None, "x": 1}, "`step` is null, not a whole number >= 0"),
    ({"step": "2"}, '`step` is "2", not a whole number >= 0'),
    ({"step": True}, "`step` is true, not a whole number >= 0"),
    ({"step": 1.5}, "`step` is 1.5, not a whole number >= 0"),
    ({"step": -1}, "`step` is -1, not a whole number >= 0"),
    ({"wall_time": 1.0}, "no `step`"),
])
def test_a_row_without_a_whole_step_is_a_malformed_line_naming_it(tmp_path, row, why):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "x": 0}) + "\n" + json.dumps(row) + "\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(GymvError, match="malformed metrics line: " + why.replace("(", r"\(")) as err:
        read_metrics(path)
    assert err.value.where == f"{path}:2"
    skipped = []
    assert [r["step"] for r in read_metrics(path, skipped)] == [1, 3] and skipped == [(2, why)]
