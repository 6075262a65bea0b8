"""The report page in a real headless browser (Debian's chromium), opened from file:// with no network: the
rollout viewer renders a prompt image and a tool-result image (loaded from the folder), the tool call with its
arguments, model text as text (never markup), and filters read from the page address."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from gymv.report import build_report
from report_run import TOOL_TEXT, make_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (CI installs Debian's chromium)")


def chromium(tmp_path, url: str, *extra: str, size: str = "1400,20000") -> str:
    """Run headless chromium on `url`; the tall default window lays out (and loads) every rollout."""
    profile = tmp_path / "profile"
    p = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
         f"--window-size={size}", "--virtual-time-budget=5000", *extra, url],
        capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("browser")
    return build_report(make_run(base / "run", steps=2), base / "report")


@pytest.fixture(scope="module")
def dom(report, tmp_path_factory) -> str:
    return chromium(tmp_path_factory.mktemp("chrome"), report.index.as_uri(), "--dump-dom")


def test_the_viewer_shows_every_rollout_of_the_run(dom, report):
    assert re.search(r'id="count">8 of 8 rollouts<', dom)
    assert dom.count('class="rollout"') == report.rollouts == 8


def test_rollout_images_load_from_the_folder_offline(dom):
    imgs = re.findall(r'<img [^>]*src="(images/[0-9a-f]+\.png)"[^>]*>', dom)
    assert len(imgs) == 16  # each rollout: its prompt image and the zoom tool's image
    # the page enlarges small images once they have loaded, so this style proves the file was read
    loaded = re.findall(r'<img [^>]*src="images/[^"]+"[^>]*style="width: \d+px; image-rendering: pixelated;"', dom)
    assert len(loaded) == 16


def test_a_tool_call_shows_its_name_and_arguments_and_its_result(dom):
    assert re.search(r'tool call → click</div><pre class="args">click\(\{"x": \d+, "y": \d+\}\)</pre>', dom)
    assert "tool result ← zoom" in dom and TOOL_TEXT in dom


def test_model_text_is_shown_as_text_never_as_markup(dom):
    assert "I clicked the &lt;b&gt;target&lt;/b&gt; circle." in dom
    assert "<b>target</b>" not in dom


def test_filters_in_the_page_address_select_rollouts_by_reward_and_step(report, tmp_path):
    dom = chromium(tmp_path, report.index.as_uri() + "#rmin=0.5&step=2", "--dump-dom")
    assert re.search(r'id="count">2 of 8 rollouts<', dom)
    rewards = re.findall(r'class="reward">reward ([0-9.]+)<', dom)
    steps = re.findall(r"<span>step (\d+)</span>", dom)
    assert rewards == ["1.000", "1.000"] and steps == ["2", "2"]


def test_a_screenshot_of_the_page_is_drawn(report, tmp_path):
    from PIL import Image

    shot = tmp_path / "page.png"
    chromium(tmp_path, report.index.as_uri(), f"--screenshot={shot}", size="1200,2400")
    with Image.open(shot) as img:
        assert img.size == (1200, 2400)
        histogram = img.convert("L").histogram()
        assert sum(1 for n in histogram if n) > 50  # text, plots and images, not a blank page
