"""compare.pair: a diff row's two tensors read back as the diff compared them."""

from __future__ import annotations

import numpy as np
import pytest

from layerdiff.compare import diff, read_pair
from layerdiff.compare.pair import PairReader
from layerdiff.errors import TraceError
from layerdiff.trace import TraceWriter

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((2, 3)).astype(np.float32)
K = RNG.standard_normal((2, 3)).astype(np.float32)
GRAD = RNG.standard_normal((2, 3)).astype(np.float32)
GRAD_K = RNG.standard_normal((2, 3)).astype(np.float32)

MAPPING = """version = 1

[[site]]
reference = "q"
port = "qk"

[[param]]
port = "qk.weight"
reference = ["q.weight", "k.weight"]
transform = "concat"
"""


def _traces(tmp_path, *, port_scale: float, port_k: np.ndarray, port_grad: np.ndarray):
    """A reference with two weights q and k and their gradients (at loss scale 1), and a port
    holding them fused as one weight, its gradient at ``port_scale``."""
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    with TraceWriter(ref, meta={"loss_scale": 1.0}) as w:
        for name, weight, grad in (("q", Q, GRAD), ("k", K, GRAD_K)):
            with w.site(name, "Linear") as s:
                w.record(s, "weight", weight, arg="weight")
                w.record(s, "weight_grad", grad, arg="weight")
    fused_grad = np.concatenate([port_grad, GRAD_K]) * port_scale
    with TraceWriter(port, meta={"loss_scale": port_scale}) as w, w.site("qk", "Linear") as s:
        w.record(s, "weight", np.concatenate([Q, port_k]), arg="weight")
        w.record(s, "weight_grad", fused_grad.astype(np.float32), arg="weight")
    (tmp_path / "m.toml").write_text(MAPPING)
    return ref, port, tmp_path / "m.toml"


def _row(result, site, role):
    rows = result.rows
    return rows[(rows["site"] == site) & (rows["role"] == role)].iloc[0]


def test_a_backward_row_reads_the_port_gradient_at_the_references_loss_scale(tmp_path):
    """Traces captured at different --loss-scale: the port's gradient comes back multiplied
    to the reference's scale (and cut to the reference's part of the fused tensor), so the
    pair shows the port's error, not the factor 1024."""
    wrong = GRAD.copy()
    wrong[1, 2] += 0.5
    ref, port, mapping = _traces(tmp_path, port_scale=1024.0, port_k=K, port_grad=wrong)
    result = diff(ref, port, mapping=mapping)
    row = _row(result, "q#0", "weight_grad")
    got_ref, got_port = read_pair(result, row)
    assert got_ref.shape == got_port.shape == (2, 3)
    np.testing.assert_array_equal(got_ref, GRAD)
    np.testing.assert_allclose(got_port, wrong, rtol=1e-6)
    assert np.abs(got_port - got_ref).max() == pytest.approx(row["max_abs"], rel=1e-6)


def test_a_row_of_a_fused_parameter_reads_its_own_part_of_the_port_tensor(tmp_path):
    """The reference's k is rows 2..4 of the port's fused weight: the reader cuts it as the
    mapping says, so the pair holds the one element the port got wrong."""
    wrong = K.copy()
    wrong[0, 1] = 7.0
    ref, port, mapping = _traces(tmp_path, port_scale=1.0, port_k=wrong, port_grad=GRAD)
    result = diff(ref, port, mapping=mapping)
    with PairReader.of(result) as reader:
        got_ref, got_port = reader.read(_row(result, "k#0", "weight"))
        np.testing.assert_array_equal(got_ref, K)
        np.testing.assert_array_equal(got_port, wrong)
        same_ref, same_port = reader.read(_row(result, "q#0", "weight"))
        np.testing.assert_array_equal(same_ref, same_port)


def test_a_summary_trace_is_refused_in_one_sentence(tmp_path):
    ref, port, mapping = _traces(tmp_path, port_scale=1.0, port_k=K, port_grad=GRAD)
    result = diff(ref, port, mapping=mapping)
    summary = tmp_path / "summary.h5"
    with TraceWriter(summary, meta={"loss_scale": 1.0}, summary=True) as w, w.site(
            "qk", "Linear") as s:
        w.record(s, "weight", np.concatenate([Q, K]), arg="weight")
    result.port = summary
    with pytest.raises(TraceError, match="summary trace"):
        read_pair(result, _row(result, "q#0", "weight"))
