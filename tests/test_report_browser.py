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
    assert len(imgs) == 12  # each of 4 groups: its prompt image once; each of 8 rollouts: the zoom tool's image
    # the page enlarges small images once they have loaded, so this style proves the file was read
    loaded = re.findall(r'<img [^>]*src="images/[^"]+"[^>]*style="width: \d+px; image-rendering: pixelated;"', dom)
    assert len(loaded) == 12


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


def test_a_grpo_group_is_one_card_with_the_prompt_image_once_and_its_samples(dom):
    cards = re.split(r'<details class="group"', dom)[1:]
    assert len(cards) == 4  # 2 steps x 2 prompts
    for card in cards:
        assert card.count('class="rollout"') == 2
        prompt = card[:card.index('class="samples"')]
        assert len(re.findall(r'<img [^>]*src="images/', prompt)) == 1


def test_groups_come_newest_step_first(dom):
    assert re.findall(r'<details class="group"[^>]*><summary><span>step (\d+)</span>', dom) == ["2", "2", "1", "1"]


def test_each_sample_shows_its_reward_advantage_and_expected_vs_parsed_answer(dom):
    assert re.search(r'class="adv pos">advantage \+1\.000<', dom) and re.search(r'class="adv neg">advantage -1\.000<', dom)
    assert re.search(r'class="answer ok">expected inside the \w+ circle at \(\d+, \d+\), radius \d+ · parsed click \(\d+, \d+\)<', dom)
    assert re.search(r'class="answer wrong">expected inside the \w+ circle [^<]* · parsed click \(0, 0\)<', dom)


def _pixels(path, rgb) -> int:
    from PIL import Image

    with Image.open(path) as img:
        return sum(1 for p in img.convert("RGB").get_flattened_data() if p == rgb)


def test_a_screenshot_shows_the_group_card_with_colored_advantages_and_plots(report, tmp_path):
    shot = tmp_path / "page.png"
    chromium(tmp_path, report.index.as_uri() + "#step=2", f"--screenshot={shot}", size="1400,6000")
    green, red = (0x1a, 0x7f, 0x37), (0xc6, 0x28, 0x28)  # --ok and --bad: positive and negative advantages
    assert _pixels(shot, green) > 20 and _pixels(shot, red) > 20
    from PIL import Image

    with Image.open(shot) as img:
        # the plots grid: many distinct colors (lines, bands, legends) in the upper part of the page
        top = img.convert("RGB").crop((0, 0, 1400, 1600))
        assert len(set(top.get_flattened_data())) > 200
