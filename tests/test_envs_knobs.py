"""Generator knobs: presets, KEY=VALUE overrides with types, and checks that refuse impossible settings."""

from __future__ import annotations

import pytest

from gymv.envs import get_env
from gymv.envs.knobs import describe_knobs, resolve_knobs
from gymv.errors import GymvError

COUNT = get_env("circle-count")


def test_tiny_preset_knobs_are_explicit():
    k = resolve_knobs(COUNT, "tiny")
    assert (k.image_size, k.radius, k.circles, k.colors, k.overlap) == ((56, 56), (7, 7), (1, 3), (1, 1), False)


def test_overrides_parse_ranges_single_values_names_and_booleans():
    k = resolve_knobs(COUNT, "tiny", ["circles=1:5", "radius=6", "palette=red,blue", "colors=1:2", "overlap=true"])
    assert (k.circles, k.radius, k.palette, k.colors, k.overlap) == ((1, 5), (6, 6), ("red", "blue"), (1, 2), True)


def test_dashes_in_knob_names_are_accepted():
    assert resolve_knobs(COUNT, "tiny", ["min-gap=4"]).min_gap == 4


def test_unknown_knob_is_refused_with_the_list_of_knobs():
    with pytest.raises(GymvError, match="no knob 'size'.*image_size"):
        resolve_knobs(COUNT, "default", ["size=5"])


def test_override_without_equals_is_refused():
    with pytest.raises(GymvError, match="not KEY=VALUE"):
        resolve_knobs(COUNT, "default", ["circles"])


def test_reversed_range_is_refused():
    with pytest.raises(GymvError, match="empty range"):
        resolve_knobs(COUNT, "default", ["circles=5:1"])


def test_non_numeric_range_is_refused():
    with pytest.raises(GymvError, match="not a valid range"):
        resolve_knobs(COUNT, "default", ["radius=big"])


def test_circles_that_cannot_fit_in_the_image_are_refused():
    with pytest.raises(GymvError, match="does not fit"):
        resolve_knobs(COUNT, "tiny", ["radius=40"])


def test_unknown_palette_color_is_refused():
    with pytest.raises(GymvError, match="unknown color 'mauve'"):
        resolve_knobs(COUNT, "default", ["palette=red,mauve"])


def test_more_colors_than_the_palette_holds_is_refused():
    with pytest.raises(GymvError, match="palette size"):
        resolve_knobs(COUNT, "default", ["palette=red,blue", "colors=3"])


def test_click_needs_a_palette_color_per_circle():
    with pytest.raises(GymvError, match="distinct colors"):
        resolve_knobs(get_env("circle-click"), "default", ["palette=red,blue"])


def test_unknown_preset_is_refused_with_the_known_ones():
    with pytest.raises(GymvError, match="no preset 'huge'.*default, tiny"):
        resolve_knobs(COUNT, "huge")


def test_every_knob_has_a_help_line():
    assert all(help_ for _, _, help_ in describe_knobs(resolve_knobs(COUNT, "default")))
