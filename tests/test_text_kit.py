"""The one text kit: every cut line fits the width and keeps the end that says most."""

import math

from hypothesis import given
from hypothesis import strategies as st

from layerdiff.report.text import (
    WIDTH,
    clip,
    clip_left,
    clip_middle,
    number,
    ranges,
    shape,
    wrap,
    wrap_lines,
)


@given(st.text(max_size=300), st.integers(min_value=2, max_value=120))
def test_every_clip_fits_the_width_and_keeps_short_text_whole(text, width):
    for cut in (clip, clip_left, clip_middle):
        out = cut(text, width)
        assert len(out) <= width
        if len(text) <= width:
            assert out == text


def test_clips_keep_the_part_that_names_the_thing():
    name = "model.layers.31.self_attn.q_proj.weight"
    assert clip_left(name, 20).endswith("q_proj.weight")
    assert clip("Origin at blocks.1 backward", 10).startswith("Origin at")
    middle = clip_middle("a" * 50 + "b" * 50, 21)
    assert middle.startswith("aaaa") and middle.endswith("bbbb")


def test_numbers_read_the_same_everywhere():
    assert number(None) == "-"
    assert number(math.nan) == "-"
    assert number(math.nan, nan="nan") == "nan"
    assert number(math.inf) == "inf" and number(-math.inf) == "-inf"
    assert number(0.000123456, 3) == "0.000123"
    assert number(12345678.0) == "1.235e+07"


@given(st.lists(st.text(alphabet="ab ", max_size=40), max_size=8))
def test_wrapped_lines_fit(lines):
    assert all(len(line) <= WIDTH for line in wrap_lines(lines))
    assert all(len(line) <= 30 for line in wrap(" ".join(lines), 30, indent="  "))


def test_shapes_and_ranges():
    assert shape((4, 16, 64)) == "(4,16,64)"
    assert ranges([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
