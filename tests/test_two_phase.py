"""Two-phase capture for models too big to capture in full: a --summary diff names the origin,
then --full-around keeps tensor data only around it (statistics everywhere else)."""

from __future__ import annotations

import shlex

import numpy as np
import pytest

from layerdiff import capture, diff, load_case, open_trace
from layerdiff.capture.hooks import around_modules
from layerdiff.errors import CaptureError
from reference_models import op_bugs

REFERENCE = f"{op_bugs.MODULE}:reference"
BUG = f"{op_bugs.MODULE}:bug_softmax_axis"


def test_around_means_the_module_what_is_inside_and_its_nearest_siblings():
    model = load_case(REFERENCE).model
    assert around_modules(model, ["blocks.0.attn#0"], 1) == {
        "blocks.0.ln1", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj",
        "blocks.0.ln2"}
    assert around_modules(model, ["blocks.0.attn#0/softmax#0"], 0) == {
        "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj"}
    assert "blocks.1.mlp.fc" in around_modules(model, ["blocks.0"], 1)
    with pytest.raises(CaptureError, match=r"--full-around 'blocks\.7' names no module"):
        around_modules(model, ["blocks.7"], 1)


def test_full_around_keeps_data_there_and_the_same_statistics_elsewhere(tmp_path):
    full = capture(load_case(REFERENCE), tmp_path / "full.h5")
    # a small ring, so that kept and statistics-only records interleave in it and wrap
    part = capture(load_case(REFERENCE), tmp_path / "part.h5", full_around=["blocks.1.mlp"],
                   radius=0, queue_bytes=1 << 16)
    with open_trace(full) as a, open_trace(part) as b:
        keys = ["step", "site", "role", "arg"]
        left, right = a.index.set_index(keys), b.index.set_index(keys)
        assert (left["digest"] == right.loc[left.index, "digest"]).all()
        kept = b.index[b.index["segment"] >= 0]
        assert set(kept["site"]) == {"blocks.1.mlp#0", "blocks.1.mlp.fc#0",
                                     "blocks.1.mlp.out#0", "<loss>#0"}
        position = {key: i for i, key in enumerate(zip(*(a.index[k] for k in keys),
                                                       strict=True))}
        for _, row in kept.iterrows():   # the kept bytes are the full capture's
            twin = a.index.iloc[position[tuple(row[k] for k in keys)]]
            np.testing.assert_array_equal(a.read(twin), b.read(row))
        assert b.meta["full_around"]["modules"] == ["blocks.1.mlp", "blocks.1.mlp.fc",
                                                    "blocks.1.mlp.out"]
    assert part.stat().st_size < full.stat().st_size / 3


def test_summary_diff_suggests_the_second_phase_which_shows_the_element_error(run, tmp_path):
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    assert run("capture", REFERENCE, "-o", ref, "--summary").exit_code == 0
    assert run("capture", BUG, "-o", port, "--summary").exit_code == 0
    first = run("diff", ref, port)
    assert first.exit_code == 1 and "FAIL  origin: blocks.0.attn#0, forward output" in first.output
    text = first.output.split("likely cause:\n", 1)[1].split("\n\n", 1)[0]
    commands = [shlex.split(c) for c in text.replace("\\\n", " ").splitlines() if c.strip()]
    assert [c[:2] for c in commands] == [["layerdiff", "capture"]] * 2 + [["layerdiff", "diff"]]
    assert "--summary" not in commands[0] and "--full-around" in commands[0]
    for command in commands[:2]:
        assert run(*command[1:]).exit_code == 0
    second = diff(commands[2][2], commands[2][3])
    origin = second.origin
    assert (origin.site, origin.pass_) == ("blocks.0.attn#0", "forward")
    assert origin.hint is not None and origin.hint["kind"] == "axis"  # read from tensor data
    assert second.meta["full_commands"] == []
    elsewhere = second.rows[second.rows["site"] == "blocks.1.mlp#0"]
    assert elsewhere["note"].str.contains("statistics only").all()


def test_full_around_refuses_summary(tmp_path):
    with pytest.raises(CaptureError, match="cannot be combined with --summary"):
        capture(load_case(REFERENCE), tmp_path / "x.h5", summary=True, full_around=["blocks.0"])
    assert not (tmp_path / "x.h5").exists()
