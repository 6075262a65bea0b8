"""`gymv report`: plots and a self-contained rollout viewer, from run directories written by gymv's own writers,
finished or still in progress; served on 127.0.0.1 with rebuilds when the run moves on."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image as PILImage

from gymv.errors import GymvError
from gymv.report import build_report, serve_report
from gymv.report.run import run_signature
from gymv.runs.metrics import MetricsLog
from gymv.runs.rollout_log import make_rollout_record
from gymv.runs.run_dir import RunDir
from report_run import TOOL_TEXT, make_run

CHECKS = ("median(train/token_mult_prob_error) < 1.1", "mean(train/reward_mean, last=3) > 0.9")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("run") / "grpo-run", checks=CHECKS, truncated_tail=True)


@pytest.fixture(scope="module")
def built(run, tmp_path_factory):
    return build_report(run, tmp_path_factory.mktemp("report") / "out")


def data_of(result) -> dict:
    text = (result.out_dir / "data.js").read_text()
    assert text.startswith("window.GYMV_REPORT = ") and text.rstrip().endswith(";")
    return json.loads(text.removeprefix("window.GYMV_REPORT = ").rstrip().rstrip(";"))


# -- plots ------------------------------------------------------------------------------------------------


def test_every_plot_is_a_png_when_its_metrics_were_logged(built):
    assert [p.name for p in built.plots] == ["reward", "accuracy", "loss", "kl", "entropy", "token_mult_prob_error",
                                             "grad_norm", "response_length", "zero_std_groups", "lr", "timing"]
    for p in built.plots:
        with PILImage.open(built.out_dir / p.file) as img:
            assert img.format == "PNG" and img.width >= 400


def test_the_reward_plot_draws_the_per_environment_breakdown_beside_the_total(built):
    reward = next(p for p in built.plots if p.name == "reward")
    assert reward.metrics == ("train/reward_mean", "train/reward_mean/circle_click_simple_agent", "val/reward_mean")


def test_the_timing_split_stacks_phases_that_do_not_overlap(built):
    timing = next(p for p in built.plots if p.name == "timing")
    assert "timing/env_s" not in timing.metrics  # the environment's time is inside generation's
    assert set(timing.metrics) == {"timing/generation_s", "timing/logprobs_s", "timing/training_s", "timing/refit_s"}


def test_a_plot_without_data_is_left_out(tmp_path):
    run = RunDir.create(tmp_path / "sft", {"name": "sft", "algorithm": "vlm_sft"})
    with run.metrics_log() as log:
        log.log(1, {"train/loss": 2.0, "train/nll": 2.0})
    result = build_report(run.path, tmp_path / "out")
    assert [p.name for p in result.plots] == ["loss"]
    assert sorted(f.name for f in (tmp_path / "out" / "plots").iterdir()) == ["loss.png"]


def test_a_mopd_run_with_a_sequence_error_threshold_gets_its_health_plots(tmp_path):
    run = RunDir.create(tmp_path / "mopd", {"name": "mopd", "algorithm": "vlm_mopd"})
    with run.metrics_log() as log:
        for s in (1, 2):
            log.log(s, {"train/loss": 0.1, "train/teacher_advantage": -0.2, "train/teacher_advantage_min": -3.0,
                        "train/teacher_advantage_max": 1.5, "train/num_teacher_batches": 2.0,
                        "train/max_seq_mult_prob_error": 1.02, "train/mean_seq_mult_prob_error": 1.01,
                        "train/min_seq_mult_prob_error": 1.0, "train/max_seq_mult_prob_error_after_mask": 1.02,
                        "train/num_masked_seqs_by_logprob_error": 0.0})
    result = build_report(run.path, tmp_path / "out")
    assert [p.name for p in result.plots] == ["loss", "seq_mult_prob_error", "masked_seqs", "teacher_advantage",
                                              "teacher_batches"]
    advantage = next(p for p in result.plots if p.name == "teacher_advantage")
    assert advantage.metrics == ("train/teacher_advantage", "train/teacher_advantage_min", "train/teacher_advantage_max")


# -- a run in progress --------------------------------------------------------------------------------------


def test_a_run_in_progress_is_reported_up_to_its_last_complete_line(built):
    assert (built.last_step, built.finished) == (4, False)
    assert "step 4 of 40 (in progress)" in built.index.read_text()


def test_a_run_with_only_its_config_yet_gives_an_empty_report(tmp_path):
    RunDir.create(tmp_path / "new", {"name": "new", "algorithm": "vlm_grpo"})
    result = build_report(tmp_path / "new", tmp_path / "out")
    assert (result.plots, result.rollouts, result.last_step) == ((), 0, None)
    assert "No metrics logged yet." in result.index.read_text()


def test_a_directory_that_is_not_a_run_is_an_error(tmp_path):
    with pytest.raises(GymvError, match="not a gymv run directory"):
        build_report(tmp_path, tmp_path / "out")


# -- the rollout viewer's data ------------------------------------------------------------------------------


def test_each_rollout_keeps_its_step_reward_and_environment(built):
    views = data_of(built)["rollouts"]
    assert len(views) == built.rollouts == 16
    assert sorted({v["step"] for v in views}) == [1, 2, 3, 4]
    assert {(v["rollout"], v["reward"]) for v in views} == {(0, 1.0), (1, 0.0)}  # sample 0 clicks the target
    assert {v["agent"] for v in views} == {"circle_click_simple_agent"}


def test_entries_are_grouped_into_turns_with_tool_calls_and_named_results(built):
    v = data_of(built)["rollouts"][0]
    shape = [(e["turn"], e["kind"], e.get("role") or e.get("name")) for e in v["entries"]]
    assert shape == [(0, "message", "user"), (1, "message", "assistant"), (1, "tool_call", "click"),
                     (1, "tool_call", "zoom"), (1, "tool_result", "click"), (1, "tool_result", "zoom"),
                     (2, "message", "assistant")]
    assert v["turns"] == 2
    assert re.fullmatch(r'\{"x": \d+, "y": \d+\}', v["entries"][2]["arguments"])


def test_token_ids_and_logprobs_stay_out_of_the_viewer(built):
    text = (built.out_dir / "data.js").read_text()
    assert "generation_log_probs" not in text and "prompt_token_ids" not in text


def test_images_are_files_in_the_folder_and_a_shared_image_is_stored_once(built):
    views = data_of(built)["rollouts"]
    srcs = [p["src"] for v in views for e in v["entries"] for p in e.get("parts", []) if p.get("kind") == "image"]
    assert len(srcs) == 32  # a prompt image and a tool image in each of 16 rollouts
    assert len(set(srcs)) == built.images == 4  # 2 prompts x (prompt image + zoom crop)
    for s in set(srcs):
        assert re.fullmatch(r"images/[0-9a-f]{20}\.png", s) and (built.out_dir / s).is_file()


def test_a_tool_result_image_is_attached_to_its_tool_result(built):
    zoom = next(e for e in data_of(built)["rollouts"][0]["entries"] if e["kind"] == "tool_result" and e["name"] == "zoom")
    assert [p["kind"] for p in zoom["parts"]] == ["text", "image"] and zoom["parts"][0]["text"] == TOOL_TEXT


def test_an_svg_or_non_image_data_url_is_never_written(tmp_path):
    run = RunDir.create(tmp_path / "r", {"name": "r", "algorithm": "vlm_grpo"})
    svg = "data:image/svg+xml;base64,PHN2ZyBvbmxvYWQ9ImFsZXJ0KDEpIi8+"
    fake_png = "data:image/png;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg=="
    row = {"responses_create_params": {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": svg}, {"type": "input_image", "image_url": fake_png},
        {"type": "input_text", "text": "hi"}]}]}}
    out = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]
    run.write_rollouts(1, [make_rollout_record(row, out, 0.0)])
    result = build_report(run.path, tmp_path / "out")
    parts = data_of(result)["rollouts"][0]["entries"][0]["parts"]
    assert [("src" in p, "missing" in p) for p in parts[:2]] == [(False, True), (False, True)]
    assert not (tmp_path / "out" / "images").exists()


def test_the_folder_needs_no_network_and_every_reference_resolves(built):
    page = built.index.read_text()
    assert not re.search(r"https?://", page)
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert "data.js" in refs
    assert all((built.out_dir / r).is_file() for r in refs)


def test_the_recipe_checks_are_evaluated_on_the_page(built):
    assert [c.status for c in built.checks] == ["pass", "fail"]
    page = built.index.read_text()
    assert "median(train/token_mult_prob_error) = 1.025" in page and 'class="fail">FAIL' in page


def test_building_again_refreshes_the_report_with_new_steps(tmp_path):
    run = make_run(tmp_path / "r", steps=2)
    first = build_report(run, tmp_path / "out")
    with MetricsLog(run / "metrics.jsonl") as log:
        log.log(3, {"train/reward_mean": 0.9})
    again = build_report(run, tmp_path / "out")
    assert (first.last_step, again.last_step) == (2, 3)


# -- the command ----------------------------------------------------------------------------------------------


def test_cli_writes_the_report_and_prints_json(run, tmp_path, gymv):
    r = gymv("report", run, "--out", tmp_path / "rep", "--json")
    assert r.code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["rollouts"] == 16 and out["last_step"] == 4 and Path(out["index"]).is_file()


def test_cli_on_a_missing_directory_is_a_one_line_error(tmp_path, gymv):
    r = gymv("report", tmp_path / "nope")
    assert r.code == 2 and r.stderr.strip().count("\n") == 0 and "run directory not found" in r.stderr


# -- serving ------------------------------------------------------------------------------------------------


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def test_the_server_binds_127_0_0_1_and_rebuilds_when_the_run_moves_on(tmp_path):
    run = make_run(tmp_path / "r", steps=2)
    sig = run_signature(run)
    build_report(run, tmp_path / "out")
    server = serve_report(tmp_path / "out", run, signature=sig)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert server.server_address[0] == "127.0.0.1"
        assert "step 2 of 40" in get(server.url) and server.rebuilds == 0
        with MetricsLog(run / "metrics.jsonl") as log:
            log.log(3, {"train/reward_mean": 0.9})
        assert "step 3 of 40" in get(server.url) and server.rebuilds == 1
        assert get(server.url + "data.js").startswith("window.GYMV_REPORT")
        assert get(server.url) and server.rebuilds == 1  # nothing new: no rebuild
    finally:
        server.shutdown()
        server.server_close()


def test_cli_serve_prints_the_url_and_serves_until_interrupted(run, tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "gymv_cli.main", "report", str(run), "--out", str(tmp_path / "rep"),
                          "--serve"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**__import__("os").environ, "NO_COLOR": "1", "COLUMNS": "200", "PYTHONFAULTHANDLER": "1"},
                         # a suite started in the background (`cmd &`) ignores SIGINT, and a Python started with
                         # SIGINT ignored never turns it into KeyboardInterrupt: the server would not stop
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 60
        url = None
        while time.time() < deadline and url is None:
            line = p.stdout.readline()
            m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            url = m.group(1) if m else None
        assert url, "no URL printed"
        assert "Rollouts" in get(url)
        p.send_signal(signal.SIGINT)
        try:
            assert p.wait(timeout=20) == 0
        except subprocess.TimeoutExpired:  # its threads' stacks say where it hung
            p.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER dumps every thread's traceback
            _, err = p.communicate(timeout=30)
            pytest.fail(f"the server was still running 20 s after SIGINT; its stderr ends: {err[-3000:]!r}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_report_engine_loads_without_torch():
    code = "import sys, gymv.report; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- what a researcher reads: answers, advantages, groups, newest first, smoothing, comparison ------------------


def test_each_rollout_shows_its_expected_and_parsed_answer_and_its_advantage(built):
    views = data_of(built)["rollouts"]
    hit = next(v for v in views if v["reward"] == 1.0)
    miss = next(v for v in views if v["reward"] == 0.0)
    assert re.fullmatch(r"inside the \w+ circle at \(\d+, \d+\), radius \d+", hit["expected"])
    assert re.fullmatch(r"click \(\d+, \d+\)", hit["parsed"]) and miss["parsed"] == "click (0, 0)"
    assert (hit["advantage"], miss["advantage"]) == (1.0, -1.0)


def test_answers_are_read_from_each_verifiers_fields():
    from gymv.report.viewer import answers

    assert answers({"expected_count": 7, "predicted_count": 5}) == ("7", "5")
    assert answers({"expected_answer": 12, "predicted_answer": None}) == ("12", "none")
    assert answers({"expected": "red", "answer": "blue"}) == ("red", "blue")
    assert answers({"reward": 1.0}) == (None, None)


def test_rollouts_come_newest_step_first(built):
    steps = [v["step"] for v in data_of(built)["rollouts"]]
    assert steps == sorted(steps, reverse=True) and steps[0] == 4


def test_a_grpo_group_is_one_card_holding_its_samples_and_its_prompt_once(built):
    data = data_of(built)
    groups = data["groups"]
    assert len(groups) == 8  # 4 steps x 2 prompts
    assert all(len(g["samples"]) == 2 for g in groups)
    first = groups[0]
    assert (first["step"], first["task"], first["reward_mean"], first["zero_std"]) == (4, 0, 0.5, False)
    assert [e["kind"] for e in first["prompt"]] == ["message"]
    assert {data["rollouts"][i]["task"] for i in first["samples"]} == {0}


def test_smoothing_is_a_debiased_moving_average():
    from gymv.report.plots import smooth

    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([0.0, 1.0], 0.0) == [0.0, 1.0]
    s = smooth([0.0, 1.0, 1.0, 1.0], 0.6)
    assert s[0] == 0.0 and all(a < b < 1.0 for a, b in zip(s[1:], s[2:]))


def test_the_reward_band_stays_inside_0_1():
    from gymv.report.plots import band_edges

    lows, highs = band_edges([0.1, 0.5, 0.95], [0.3, 0.2, 0.3], (0.0, 1.0))
    assert lows == pytest.approx([0.0, 0.3, 0.65]) and highs == pytest.approx([0.4, 0.7, 1.0])
    lows, highs = band_edges([0.1], [0.3], None)
    assert lows[0] == pytest.approx(-0.2)


def test_two_runs_are_compared_on_one_page(run, tmp_path):
    other = make_run(tmp_path / "other-run", steps=3)
    result = build_report(run, tmp_path / "out", compare=[other])
    page = result.index.read_text()
    assert "compared with other-run (dashed)" in page
    latest = page[page.index('id="latest"'):page.index("</section>", page.index('id="latest"'))]
    assert "<th>grpo-run</th><th>other-run</th>" in latest
    assert re.search(r"<td>train/reward_mean</td><td class=\"num\">0\.4</td><td class=\"num\">0\.3</td>", latest)
    assert "reward" in [p.name for p in result.plots]


def test_cli_compares_and_smooths(run, tmp_path, gymv):
    other = make_run(tmp_path / "other-run", steps=2)
    r = gymv("report", run, "--out", tmp_path / "out", "--compare", other, "--smoothing", "0.9", "--json")
    assert r.code == 0, r.stderr
    assert "compared with other-run" in (tmp_path / "out" / "index.html").read_text()
    bad = gymv("report", run, "--out", tmp_path / "out2", "--smoothing", "1.5")
    assert bad.code == 2 and "Traceback" not in bad.stderr


# -- damaged metrics ----------------------------------------------------------------------------------------


def test_a_bad_line_in_the_middle_of_the_metrics_is_skipped_naming_its_line_and_the_rest_plotted(tmp_path):
    run = make_run(tmp_path / "run", steps=4)
    lines = (run / "metrics.jsonl").read_bytes().split(b"\n")
    lines[2:2] = [b"{not json", b'{"step": 9, "train/loss": \xff\xfe}']  # malformed, and not UTF-8
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines))
    result = build_report(run, tmp_path / "out")
    assert result.last_step == 4 and len(result.plots) == 11
    assert [p.split(": line skipped")[0].rsplit(":", 1)[1] for p in result.problems] == ["3", "4"]
    assert "not UTF-8" in result.problems[1]


def test_non_finite_values_are_gaps_with_a_marker_counted_in_the_header(tmp_path):
    run = RunDir.create(tmp_path / "sft", {"name": "sft", "algorithm": "vlm_sft"})
    with run.metrics_log() as log:
        for step, loss in enumerate([2.0, float("nan"), 1.5, float("inf"), 1.0], 1):
            log.log(step, {"train/loss": loss})
    with open(run.metrics_path, "a") as f:  # as other tools write them
        f.write('{"step": 6, "train/loss": "0.9"}\n{"step": 7, "train/loss": NaN}\n')
    result = build_report(run.path, tmp_path / "out")
    assert "4 metric values not finite numbers (null, NaN, inf or text; steps 2, 4, 6, 7)" in result.index.read_text()
    assert [p.name for p in result.plots] == ["loss"]


def test_a_series_is_broken_at_its_gaps_and_marked_there():
    from matplotlib.figure import Figure

    from gymv.report.plots import _draw

    ax = Figure().add_subplot()
    line = _draw(ax, [1, 3, 5], [2.0, 1.5, 1.0], "train/loss", 0.0, gaps=[2, 4])
    assert list(line.get_xdata()) == [1, 2, 3, 4, 5]
    assert [y != y for y in line.get_ydata()] == [False, True, False, True, False]  # NaN breaks the line
    marks = [ln for ln in ax.get_lines() if ln.get_marker() == "x"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [2, 4]


def test_a_missing_metrics_file_is_said(tmp_path):
    run = RunDir.create(tmp_path / "run", {"name": "run", "algorithm": "vlm_grpo"})
    run.metrics_path.unlink(missing_ok=True)
    result = build_report(run.path, tmp_path / "out")
    assert any("metrics.jsonl: not found" in p for p in result.problems)
