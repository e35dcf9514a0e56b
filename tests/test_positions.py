"""The error by position: planted bugs in tiny sequence models (tests/position_cases.py) are
told by where along the sequence they err, in the origin, its JSON and the terminal."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from layerdiff import capture, diff, load_case
from layerdiff.compare.positions import Tokens, pattern, sequence_axis
from layerdiff.report.findings.diff import position_line
from layerdiff.report.terminal import format_diff

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = "tests.position_cases"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("positions")
    return {name: capture(load_case(f"{CASES}:{name}"), folder / f"{name}.h5")
            for name in ("padding_reference", "padding_off_by_one", "rotary_reference",
                         "rotary_base")}


@pytest.fixture(scope="module")
def padding(traces):
    return diff(traces["padding_reference"], traces["padding_off_by_one"])


def test_a_padding_mask_off_by_one_is_out_from_its_position(padding):
    origin = padding.origin
    assert origin.site == "mixer#0" and origin.position_axis == 1
    assert len(origin.positions) == 12
    found = pattern(origin.positions)
    assert found.out == [8, 9, 10, 11] and found.first == 8 and not found.growing
    text = " ".join(format_diff(padding).split())
    assert "by position: within at 0-7, out from 8 (first 8, worst " in text


def test_a_rotary_base_error_grows_with_the_position(traces):
    result = diff(traces["rotary_reference"], traces["rotary_base"])
    origin = result.origin
    assert origin.site == "mixer#0"
    found = pattern(origin.positions)
    assert found.first == 1 and found.within == [0] and found.run_to_end and found.growing
    text = " ".join(format_diff(result).split())  # the terminal wraps long lines
    assert "by position: within at 0, out from 1 (first 1, worst " in text
    assert "; the error grows with the position (1: " in text


def test_the_json_carries_the_vector_of_the_origin_and_of_every_failing_record(padding):
    data = json.loads(json.dumps(padding.as_json()))
    assert data["origin"]["position_axis"] == 1
    assert np.allclose(data["origin"]["positions"], padding.origin.positions)
    records = {(entry["site"], entry["role"], entry["arg"]): entry for entry in data["positions"]}
    failing = padding.failing()
    # every failing activation record of (batch, length, ...) shape has one; the loss has none
    assert ("mixer#0", "output", "0") in records and ("head#0", "output", "0") in records
    assert len(records) == sum(str(shape).startswith("3,12") for shape in failing["shape"])
    assert all(len(entry["ratios"]) == 12 and entry["axis"] == 1
               for entry in records.values())


def test_a_passing_diff_reads_nothing_more(traces):
    result = diff(traces["padding_reference"], traces["padding_reference"])
    assert result.passed and result.positions == {} and result.as_json()["positions"] == []


def test_the_sequence_axis_is_found_from_the_token_ids_or_declared():
    tokens = Tokens(batch=3, length=12)
    assert sequence_axis((3, 12, 16), tokens) == 1
    assert sequence_axis((3, 4, 12, 4), tokens) == 2      # heads first: per-head states
    assert sequence_axis((3, 4, 12, 12), tokens) == 2     # attention probabilities: queries
    assert sequence_axis((3, 4, 16, 12), tokens) is None  # the length's size only last: hidden
    assert sequence_axis((3, 4, 12, 12, 5), tokens) is None  # two axes could be it
    assert sequence_axis((4, 12, 16), tokens) is None     # another batch
    assert sequence_axis((36, 16), tokens) is None        # (batch x length) flattened
    assert sequence_axis((3, 4, 12, 4), None) is None
    assert sequence_axis((3, 4, 12, 4), None, declared=2) == 2
    assert sequence_axis((3, 4, 12, 4), None, declared=-2) == 2
    assert sequence_axis((16,), None, declared=1) is None


@pytest.mark.parametrize(("ratios", "said"), [
    ([0.1, 0.2, 40.0, 0.3], "by position: out only at 2, within elsewhere (40x)"),
    ([9.0, 8.0, 0.5, 0.1], "by position: out at 0-1, within from 2 (first 0, worst 0: 9x)"),
    ([0.5, 3.0, 0.5, 7.0e3, 0.1],
     "by position: out at 1, 3, within at 0, 2, 4 (first 1, worst 3: 7e3x)"),
    ([0.5, 0.5], "by position: within at every position (0-1)"),
    ([2.0, 2.0], "by position: out at every position (0-1) (first 0, worst 0: 2x)"),
])
def test_the_line_says_where_from_the_numbers(ratios, said):
    assert position_line(ratios) == said


class _Balance(HTMLParser):
    """Open and close tags of the page, to see it is well formed."""

    VOID = frozenset({"meta", "img", "br", "hr", "input", "link", "col", "wbr", "source"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def test_the_html_report_draws_records_by_positions(padding):
    from layerdiff.report.html import render_html

    text = render_html(padding)
    balance = _Balance()
    balance.feed(text)
    assert not balance.errors and not balance.stack
    assert 'id="position-heatmap"' in text and "The origin, by position: within at 0-7" in text
    data = json.loads(re.search(r'<script type="application/json" id="position-errors">(.*?)'
                                r"</script>", text, re.S).group(1))
    assert data["records"][0] == "mixer#0 output" and data["origin_row"] == 0
    assert np.allclose(data["ratios"][0], padding.origin.positions)
    assert len(data["records"]) == len(padding.positions)


def test_a_real_browser_draws_the_heatmap(padding, tmp_path, screenshot):
    from layerdiff.report import page
    from layerdiff.report.positions_html import positions_section

    path = tmp_path / "positions.html"
    path.write_text(page.document("positions", [positions_section(padding)]))
    pixels = screenshot(path, 800)
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    # over tolerance at positions 8-11 of the first rows, within (blue) before
    assert ((red > 0.4) & (green < 0.15) & (blue < 0.2)).mean() > 0.01
    assert ((blue > 0.3) & (red < 0.1)).mean() > 0.05


def test_a_declared_axis_is_used_where_the_ids_say_nothing(traces):
    result = diff(traces["padding_reference"], traces["padding_off_by_one"], seq_axis=2)
    assert result.origin.position_axis == 2 and len(result.origin.positions) == 16


def test_the_command_takes_the_declared_axis(traces, tmp_path):
    from click.testing import CliRunner

    from layerdiff.cli import main

    out = tmp_path / "d.json"
    ran = CliRunner().invoke(main, ["diff", str(traces["padding_reference"]),
                                    str(traces["padding_off_by_one"]), "--seq-axis", "2",
                                    "--json", str(out)])
    assert ran.exit_code == 1, ran.output
    assert json.loads(out.read_text())["origin"]["position_axis"] == 2


def test_a_notebook_shows_the_line_under_the_origin(padding):
    from layerdiff.report.findings.diff import notebook_html

    assert "by position: within at 0-7, out from 8" in notebook_html(padding)
