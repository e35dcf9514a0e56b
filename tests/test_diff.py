"""The diff: every planted bug is found at its site and pass, correct ports pass, and the
origin rules (nesting, NaN, optimizer steps, loss scales, summaries) hold on small traces."""

from __future__ import annotations

import dataclasses
import json

import h5py
import numpy as np
import pytest
import torch

from layerdiff import (
    DiffError,
    MappingError,
    TraceWriter,
    capture,
    diff,
    load_case,
    load_weights,
)
from layerdiff.case import ExternalCase
from layerdiff.compare import result as R
from layerdiff.compare import save_rows_csv
from layerdiff.compare.judge import Status, Verdict
from layerdiff.trace.schema import Role
from reference_models import mlp_port
from reference_models.catalog import CATALOG, find

CHECKED = [info for info in CATALOG if info.kind in ("port", "bug")]


def _capture_port(info, reference, path):
    case = load_case(info.spec)
    if not isinstance(case, ExternalCase):  # the path users take: weights from the trace
        load_weights(case.model, reference, info.mapping_path)
    return capture(case, path)


@pytest.mark.parametrize("info", CHECKED, ids=[i.spec.split(".")[-1] for i in CHECKED])
def test_bundled_port_passes_and_planted_bug_is_found_at_its_site(info, reference_traces,
                                                                  tmp_path):
    reference = reference_traces(info.reference)
    port = _capture_port(info, reference, tmp_path / "port.h5")
    result = diff(reference, port, mapping=info.mapping_path)
    if info.kind == "port":
        assert result.passed, result.failing()[["site", "role", "ratio"]].head()
        assert result.origins == [] and bool(result)
        return
    assert not result.passed
    origin = result.origin
    assert (origin.port_site, origin.pass_, origin.step) == (info.site, info.pass_, 0)
    # every failing row before the origin's would be an earlier origin: there is none
    failing = result.failing()
    first_seq = failing.loc[failing["status"] == Status.ORIGIN, "seq"].min()
    # a bug in a container's own code reaches the child that runs next (its input, or its
    # grad_output) before the container's own output is recorded: those rows are inside it
    inside = failing["port_site"].str.startswith(info.site.rpartition("#")[0] + ".")
    assert (failing.loc[(failing["pass"] == info.pass_) & ~inside, "seq"] >= first_seq).all()


def test_backward_bug_is_reported_per_batch_element(reference_traces, tmp_path):
    info = find("reference_models.cnn_port:bug_relu_backward_batch")
    reference = reference_traces(info.reference)
    result = diff(reference, _capture_port(info, reference, tmp_path / "p.h5"))
    batch = result.origin.metrics["batch_ratio"]
    assert batch[0] <= 1 and all(r > 1 for r in batch[1:])
    forward = result.rows[result.rows["pass"] == "forward"]
    assert (forward["verdict"] != Verdict.OUT).all()


def test_json_report_has_the_documented_keys(reference_traces, tmp_path):
    info = find("reference_models.mlp_port:bug_weight_not_transposed")
    reference = reference_traces(info.reference)
    result = diff(reference, _capture_port(info, reference, tmp_path / "p.h5"))
    report = json.loads(json.dumps(result.as_json()))  # plain JSON types only
    assert report["verdict"] == "fail"
    assert {"site", "pass", "role", "step", "metrics"} <= set(report["origin"])
    assert report["origin"]["site"] == "fc2#0" and report["origin"]["pass"] == "forward"
    assert report["origin"]["metrics"]["ratio"] > 1
    assert isinstance(report["origins"], list) and isinstance(report["unmatched"], list)
    assert len(report["rows"]) == len(result.rows)
    assert set(R.ROW_COLUMNS) <= set(report["rows"][0])


# ---- origin rules on hand-written traces

def _chain(path, outputs, *, inputs=None, container_output=None, grads=None):
    """A container 'block' holding leaves 'block.a' then 'block.b' (a feeds b)."""
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    with TraceWriter(path) as w:
        with w.site("block", "Block") as block:
            w.record(block, "input", x)
            with w.site("block.a", "Linear") as a:
                w.record(a, "input", x if inputs is None else inputs)
                w.record(a, "output", outputs[0])
            with w.site("block.b", "Linear") as b:
                w.record(b, "input", outputs[0])
                w.record(b, "output", outputs[1])
            w.record(block, "output", outputs[1] if container_output is None
                     else container_output)
        for site, grad in (grads or {}).items():
            w.record(site, "grad_input", grad)
    return path


def _reference_chain(path):
    a = np.arange(24, dtype=np.float32).reshape(4, 6) / 10
    return _chain(path, [a, a * 2]), a


def test_innermost_site_is_the_origin_and_containers_hold_it(tmp_path):
    ref, a = _reference_chain(tmp_path / "ref.h5")
    wrong = a * 2
    wrong[2, 3] += 1.0
    port = _chain(tmp_path / "port.h5", [a, wrong])
    result = diff(ref, port)
    assert result.origin.site == "block.b#0" and result.origin.holders == ["block#0"]
    statuses = dict(zip(result.rows["site"] + " " + result.rows["role"], result.rows["status"],
                        strict=True))
    assert statuses["block#0 output"] == Status.HOLDS_ORIGIN
    assert result.origin.metrics["worst_index"] == "2,3"


def test_a_container_whose_children_are_right_is_itself_the_origin(tmp_path):
    """A missing residual connection: every child is exact, the container's output is not."""
    ref, a = _reference_chain(tmp_path / "ref.h5")
    port = _chain(tmp_path / "port.h5", [a, a * 2], container_output=a * 2 + 1)
    result = diff(ref, port)
    assert result.origin.site == "block#0"
    assert "its own code between its children" in result.origin.reason


def test_nan_appearing_in_the_port_is_an_origin_even_after_other_errors(tmp_path):
    ref, a = _reference_chain(tmp_path / "ref.h5")
    off = a + 0.5  # 'a' is already out of tolerance (finite)
    nan = (a * 2).copy()
    nan[1, 1] = np.nan
    port = _chain(tmp_path / "port.h5", [off, nan])
    origins = {o.site: o for o in diff(ref, port).origins}
    assert set(origins) == {"block.a#0", "block.b#0"}
    assert "NaN" in origins["block.b#0"].reason


def test_nan_in_the_reference_is_reported_not_blamed_on_the_port(tmp_path):
    a = np.ones((4, 6), np.float32)
    with_nan = a.copy()
    with_nan[0, 0] = np.nan
    ref = _chain(tmp_path / "ref.h5", [with_nan, a])
    port = _chain(tmp_path / "port.h5", [a, a])
    result = diff(ref, port)
    row = result.rows.query("site == 'block.a#0' and role == 'output'").iloc[0]
    assert row["verdict"] == Verdict.REF_NAN and row["ref_nan"] == 1
    assert result.passed


def test_shape_and_dtype_mismatches_are_row_verdicts(tmp_path):
    ref, a = _reference_chain(tmp_path / "ref.h5")
    port = _chain(tmp_path / "port.h5", [a.astype(np.float64), (a * 2).reshape(6, 4)])
    result = diff(ref, port)
    rows = result.rows.set_index(result.rows["site"] + " " + result.rows["role"])
    assert rows.at["block.b#0 output", "verdict"] == Verdict.SHAPE_MISMATCH
    assert "shapes differ" in rows.at["block.b#0 output", "note"]
    assert rows.at["block.a#0 output", "verdict"] == Verdict.WITHIN
    assert "compared in float64" in rows.at["block.a#0 output", "note"]


def test_structural_fallback_pairs_renamed_sites_with_a_confidence(tmp_path):
    x = np.ones((2, 3), np.float32)
    for path, names in ((tmp_path / "ref.h5", ("enc", "dec")), (tmp_path / "port.h5",
                                                               ("encoder", "decoder"))):
        with TraceWriter(path) as w:
            with w.site(names[0], "Linear") as s:
                w.record(s, "input", x)
                w.record(s, "output", np.ones((2, 5), np.float32))
            with w.site(names[1], "Linear") as s:
                w.record(s, "input", np.ones((2, 5), np.float32))
                w.record(s, "output", np.ones((2, 7), np.float32))
    result = diff(tmp_path / "ref.h5", tmp_path / "port.h5")
    pairs = dict(zip(result.rows["site"], result.rows["port_site"], strict=True))
    assert pairs == {"enc#0": "encoder#0", "dec#0": "decoder#0"}
    assert set(result.rows["match"]) == {"structural"}
    assert (result.rows["confidence"] == 1.0).all() and result.passed


def test_traces_with_nothing_in_common_are_refused(tmp_path):
    for path, (name, shape) in ((tmp_path / "a.h5", ("enc", (2, 3))),
                                (tmp_path / "b.h5", ("other", (5,)))):
        with TraceWriter(path) as w, w.site(name) as s:
            w.record(s, "output", np.ones(shape, np.float32))
    with pytest.raises(DiffError, match="nothing in common"):
        diff(tmp_path / "a.h5", tmp_path / "b.h5")


def test_a_tensor_larger_than_a_chunk_is_compared_in_pieces(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((4, 512, 1024)).astype(np.float32)  # 8 MiB: many chunks
    wrong = big.copy()
    wrong[3, 500, 7] += 0.5
    for path, value in ((tmp_path / "ref.h5", big), (tmp_path / "port.h5", wrong)):
        with TraceWriter(path) as w, w.site("layer") as s:
            w.record(s, "output", value)
    row = diff(tmp_path / "ref.h5", tmp_path / "port.h5").rows.iloc[0]
    assert row["worst_index"] == "3,500,7"
    assert row["frac_out"] == pytest.approx(1 / big.size)
    assert list(row["batch_ratio"] > 1) == [False, False, False, True]
    assert row["max_abs"] == pytest.approx(0.5, rel=1e-6)


# ---- steps, loss scales, summaries, weights

def test_an_optimizer_that_differs_is_an_origin_at_the_next_step(tmp_path):
    ref_case = load_case("reference_models.mlp:reference")
    ref_case.steps = 2
    port_case = mlp_port.port()
    port_case = dataclasses.replace(port_case, steps=2,
                                    optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9))
    ref, port = capture(ref_case, tmp_path / "r.h5"), capture(port_case, tmp_path / "p.h5")
    result = diff(ref, port)
    assert result.first_failing_step == 1
    assert result.origin.role == "weight" and result.origin.step == 1
    assert "optimizer" in result.origin.reason


def test_traces_with_different_loss_scales_compare(tmp_path):
    ref = capture(load_case("reference_models.mlp:reference"), tmp_path / "r.h5",
                  loss_scale=2.0**20)
    port = capture(mlp_port.port(), tmp_path / "p.h5")
    result = diff(ref, port)
    assert result.passed
    grads = result.rows[result.rows["role"].isin(["grad_input", "weight_grad"])]
    assert grads["note"].str.contains("loss scale").all()


def test_summary_traces_find_the_backward_bug_from_statistics(tmp_path):
    info = find("reference_models.cnn_port:bug_relu_backward_batch")
    ref = capture(load_case(info.reference), tmp_path / "r.h5", summary=True)
    good = capture(load_case("reference_models.cnn_port:port"), tmp_path / "g.h5", summary=True)
    bad = capture(load_case(info.spec), tmp_path / "b.h5", summary=True)
    assert diff(ref, good).passed
    result = diff(ref, bad)
    # Statistics are a weaker witness than tensors: the wrong mask keeps block.act's gradient
    # statistics within tolerance, and the error shows where it grows, one layer later.
    assert result.origin.site in (info.site, "block.bn2#0") and result.origin.pass_ == "backward"
    assert "statistics only" in result.origin.metrics["note"]


def test_summary_statistics_are_judged_with_a_bound_that_holds_for_correct_ports(tmp_path):
    """Every element within atol of a zero reference: the L2 norm differs by up to
    sqrt(n) * atol, and must not fail (it is compared as an RMS, per element)."""
    rng = np.random.default_rng(0)
    zeros = np.zeros((64, 1024), np.float32)
    noise = rng.uniform(-5e-6, 5e-6, zeros.shape).astype(np.float32)
    for path, value in ((tmp_path / "r.h5", zeros), (tmp_path / "p.h5", noise)):
        with TraceWriter(path, summary=True) as w, w.site("layer") as s:
            w.record(s, "output", value)
    assert diff(tmp_path / "r.h5", tmp_path / "p.h5").passed


def test_a_nan_in_the_reference_does_not_hide_errors_elsewhere(tmp_path):
    for path, value in ((tmp_path / "r.h5", [np.nan, 1, 2, 3]),
                        (tmp_path / "p.h5", [0, 1, 2, 300])):
        with TraceWriter(path) as w, w.site("layer") as s:
            w.record(s, "output", np.array(value, np.float32))
    row = diff(tmp_path / "r.h5", tmp_path / "p.h5").rows.iloc[0]
    assert row["verdict"] == Verdict.OUT


def test_a_weight_difference_is_the_origin_and_its_containers_hold_it(tmp_path):
    ref = capture(load_case("reference_models.mlp:reference"), tmp_path / "r.h5")
    case = mlp_port.port()
    with torch.no_grad():
        case.model.fc2.weight.add_(0.01)
    result = diff(ref, capture(case, tmp_path / "p.h5"))
    assert [(o.site, o.role) for o in result.origins] == [("fc2#0", "weight")]
    assert result.origin.holders == ["<root>#0"]


def test_weights_that_do_not_fit_name_both_sides(tmp_path):
    ref = capture(load_case("reference_models.mlp:reference"), tmp_path / "r.h5")
    mapping = tmp_path / "bad.toml"
    mapping.write_text('[[param]]\nport = "head.weight"\nreference = "fc2.weight"\n')
    with pytest.raises(MappingError, match=r"port head\.weight has shape \(10, 64\) but "
                                           r"reference fc2\.weight gives \(64, 64\)"):
        load_weights(mlp_port.MLPPort(), ref, mapping)


def test_port_without_weights_loaded_is_an_origin_at_its_weights(tmp_path):
    ref = capture(load_case("reference_models.mlp:reference"), tmp_path / "r.h5")
    case = mlp_port.port()
    with torch.no_grad():
        case.model.fc1.bias.add_(0.01)
    result = diff(ref, capture(case, tmp_path / "p.h5"))
    assert (result.origin.site, result.origin.role) == ("fc1#0", "weight")
    assert "--weights-from" in result.origin.reason


# ---- the command line

def test_cli_exit_codes_and_reports(run, reference_traces, tmp_path):
    info = find("reference_models.mlp_port:bug_weight_not_transposed")
    reference = reference_traces(info.reference)
    port = _capture_port(info, reference, tmp_path / "p.h5")
    good = _capture_port(find("reference_models.mlp_port:port"), reference, tmp_path / "g.h5")
    assert run("diff", reference, good).exit_code == 0
    result = run("diff", reference, port, "--json", tmp_path / "d.json", "--csv",
                 tmp_path / "d.csv")
    assert result.exit_code == 1
    assert result.output.splitlines()[0].startswith("FAIL  origin: fc2#0, forward output")
    assert max(len(line) for line in result.output.splitlines()) <= 100
    assert json.loads((tmp_path / "d.json").read_text())["origin"]["site"] == "fc2#0"
    assert (tmp_path / "d.csv").read_text().splitlines()[0].startswith("step,pass,seq,site")
    stdout = run("diff", reference, port, "--json", "-")
    assert json.loads(stdout.output)["verdict"] == "fail"


# the row columns as the CSV and JSON reports have always spelled them: a contract with every
# script that reads them, whatever the code calls them (compare.result.Column)
_OLD_ROW_COLUMNS = [
    "step", "pass", "seq", "site", "role", "arg", "port_site", "port_arg", "match",
    "confidence", "shape", "port_shape", "dtype", "port_dtype", "numel", "max_abs", "max_rel",
    "mean_abs", "rms", "cosine", "max_ulp", "frac_out", "worst_index", "ratio", "ref_nan",
    "ref_inf", "port_nan", "port_inf", "rtol", "atol", "tol_source", "rms_tol", "verdict",
    "note", "batch_ratio", "status", "cause"]


def test_csv_header_and_json_keys_are_the_plain_column_names(reference_traces, tmp_path):
    info = find("reference_models.mlp_port:bug_weight_not_transposed")
    reference = reference_traces(info.reference)
    result = diff(reference, _capture_port(info, reference, tmp_path / "p.h5"))
    assert list(result.rows.columns) == _OLD_ROW_COLUMNS == R.ROW_COLUMNS
    assert all(type(name) is str for name in result.rows.columns)
    header = save_rows_csv(result, tmp_path / "d.csv").read_text().splitlines()[0]
    assert header == ",".join(_OLD_ROW_COLUMNS)
    data = json.loads(json.dumps(result.as_json()))
    assert data["verdict"] == "fail" and all(list(row) == _OLD_ROW_COLUMNS
                                             for row in data["rows"])
    # a Column reads, filters and renames the frame as its string does
    rows = result.rows
    assert rows[R.Column.VERDICT].equals(rows["verdict"])
    assert rows[R.Column.ROLE].isin([Role.OUTPUT, Role.WEIGHT]).equals(
        rows["role"].isin(["output", "weight"])) and (rows["role"] == Role.OUTPUT).any()
    renamed = rows.rename(columns={R.Column.RATIO: "r"})
    assert "r" in renamed.columns and "ratio" not in renamed.columns


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text("not hdf5"), "not an HDF5 file"),
    (lambda p: h5py.File(p, "w").close(), "not a layerdiff trace"),
])
def test_cli_refuses_bad_traces_with_exit_2(run, reference_traces, tmp_path, make, message):
    bad = tmp_path / "bad.h5"
    make(bad)
    result = run("diff", reference_traces("reference_models.mlp:reference"), bad)
    assert result.exit_code == 2 and message in result.output
    assert "Traceback" not in result.output


def test_cli_names_the_line_of_a_broken_mapping(run, reference_traces, tmp_path):
    mapping = tmp_path / "m.toml"
    mapping.write_text('version = 1\n\n[[site]]\nrefrence = "a"\nport = "b"\n')
    reference = reference_traces("reference_models.mlp:reference")
    result = run("diff", reference, reference, "--map", mapping)
    assert result.exit_code == 2
    assert f"{mapping} line 3" in result.output and "did you mean 'reference'" in result.output


def test_read_pair_gives_both_tensors_of_a_row_for_drill_down(reference_traces, tmp_path):
    from layerdiff.compare import read_pair

    info = find("reference_models.mlp_port:bug_weight_not_transposed")
    reference = reference_traces(info.reference)
    result = diff(reference, _capture_port(info, reference, tmp_path / "p.h5"))
    row = result.failing().iloc[0]
    ref, port = read_pair(result, row)
    assert ref.shape == port.shape == tuple(int(s) for s in row["shape"].split(","))
    assert np.abs(ref - port).max() == pytest.approx(row["max_abs"], rel=1e-6)


def test_strict_fails_on_a_layer_missing_from_the_port(run, tmp_path):
    x = np.ones((2, 3), np.float32)
    for path, names in ((tmp_path / "ref.h5", ("a", "b")), (tmp_path / "port.h5", ("a",))):
        with TraceWriter(path) as w:
            for name in names:
                with w.site(name, "Linear") as s:
                    w.record(s, "output", x if name == "a" else np.ones((7,), np.float32))
    plain = run("diff", tmp_path / "ref.h5", tmp_path / "port.h5")
    assert plain.exit_code == 0  # listed, not failed
    strict = run("diff", tmp_path / "ref.h5", tmp_path / "port.h5", "--strict")
    assert strict.exit_code == 1 and "reference b#0" in strict.output
    result = diff(tmp_path / "ref.h5", tmp_path / "port.h5")
    assert list(result.undeclared_sites()["site"]) == ["b#0"]
