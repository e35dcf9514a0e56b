"""The HTML report: one self-contained file, escaped text, and a page a real browser draws.

The diffs here are built by hand from two tiny traces, so these tests do not depend on the
diff engine: a chain of three sites, batch 4, whose port's middle site is wrong only for batch
elements 1..3.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from layerdiff.compare.result import ROW_COLUMNS, UNMATCHED_COLUMNS, Diff, Origin
from layerdiff.report.html import write_html
from layerdiff.trace import TraceWriter

SITES = ["enc.lin1", "enc.act", "enc.lin2"]
BATCH, WIDTH = 4, 8
RTOL, ATOL = 1.3e-6, 1e-5


def _tensors(port: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, WIDTH)).astype(np.float32)
    w1 = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)
    w2 = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)
    h = x @ w1
    a = np.tanh(h)
    if port:
        a[1:] += 0.05   # the planted bug: every batch element after the first is off
    y = a @ w2
    return {"x": x, "enc.lin1": h, "enc.act": a, "enc.lin2": y}


def _write_trace(path: Path, port: bool, summary: bool = False) -> Path:
    tensors = _tensors(port)
    with TraceWriter(path, summary=summary) as w:
        previous = "x"
        sites = []
        for module in SITES:
            with w.site(module, "Layer") as site:
                w.record(site, "input", tensors[previous])
                w.record(site, "output", tensors[module])
            sites.append(site)
            previous = module
        for site in reversed(sites):
            w.record(site, "grad_input", np.ones((BATCH, WIDTH), np.float32))
    return path


def _row(seq: int, site: str, role: str, *, ratio: float = 0.0, verdict: str = "identical",
         status: str = "", cause: str = "", batch_ratio=None) -> dict:
    passes = {"output": "forward", "grad_input": "backward"}
    row = {
        "step": 0, "pass": passes[role], "seq": seq, "site": site, "role": role, "arg": "0",
        "port_site": site, "port_arg": "0", "match": "name", "confidence": 1.0,
        "shape": f"{BATCH},{WIDTH}", "port_shape": f"{BATCH},{WIDTH}", "dtype": "float32",
        "port_dtype": "float32", "numel": BATCH * WIDTH,
        "max_abs": ratio * ATOL, "max_rel": ratio * RTOL, "mean_abs": ratio * ATOL / 2,
        "rms": ratio * ATOL / 2, "cosine": 1.0 if ratio < 1 else 0.999, "max_ulp": int(ratio),
        "frac_out": 0.75 if ratio > 1 else 0.0, "worst_index": "1,0", "ratio": ratio,
        "ref_nan": 0, "ref_inf": 0, "port_nan": 0, "port_inf": 0,
        "rtol": RTOL, "atol": ATOL, "tol_source": "float32 default", "rms_tol": None,
        "verdict": verdict, "note": "", "batch_ratio": batch_ratio,
        "status": status, "cause": cause,
    }
    assert list(row) == ROW_COLUMNS
    return row


def _failing_diff(tmp_path: Path, summary: bool = False) -> Diff:
    ref = _write_trace(tmp_path / "ref.h5", port=False, summary=summary)
    port = _write_trace(tmp_path / "port.h5", port=True, summary=summary)
    act = "enc.act#0"
    rows = pd.DataFrame([
        _row(1, "enc.lin1#0", "output"),
        _row(3, act, "output", ratio=50.0, verdict="out", status="origin",
             batch_ratio=np.array([0.0, 50.0, 48.0, 45.0])),
        _row(5, "enc.lin2#0", "output", ratio=30.0, verdict="out", status="propagated",
             cause=f"{act} output"),
        _row(6, "enc.lin2#0", "grad_input", ratio=0.2, verdict="within"),
        _row(7, act, "grad_input", ratio=0.3, verdict="within"),
        _row(8, "enc.lin1#0", "grad_input"),
    ], columns=ROW_COLUMNS)
    origin = Origin(step=0, pass_="forward", site=act, port_site=act, role="output", arg="0",
                    port_arg="0",
                    reason="its output is 50x its tolerance while its input is identical",
                    metrics={"ratio": 50.0, "rtol": RTOL, "atol": ATOL})
    unmatched = pd.DataFrame([{"side": "port", "step": 0, "site": "enc.extra#0",
                               "role": "output", "arg": "0",
                               "reason": "no reference site: <enc.extra> & friends"}],
                             columns=UNMATCHED_COLUMNS)
    return Diff(reference=ref, port=port, rows=rows, origins=[origin], unmatched=unmatched,
                first_failing_step=0, meta={"steps": 1})


def _passing_diff(tmp_path: Path) -> Diff:
    ref = _write_trace(tmp_path / "ref.h5", port=False)
    rows = pd.DataFrame([_row(1, "enc.lin1#0", "output"),
                         _row(3, "enc.act#0", "output", ratio=0.5, verdict="within")],
                        columns=ROW_COLUMNS)
    return Diff(reference=ref, port=ref, rows=rows, origins=[],
                unmatched=pd.DataFrame(columns=UNMATCHED_COLUMNS), first_failing_step=None)


def test_failing_report_is_self_contained_and_names_the_origin(tmp_path):
    out = write_html(_failing_diff(tmp_path), tmp_path / "report.html")
    page = out.read_text(encoding="utf-8")
    # Nothing is fetched from the network: no external src or href at all.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    # Error plot, heatmap and histograms, all inline.
    assert page.count('<img src="data:image/png;base64,') >= 3
    assert 'id="heatmap"' in page
    assert "FAIL" in page and "enc.act#0" in page
    assert "3 of 4 batch element(s)" in page   # elements 1..3, not 0
    # Text from the traces is escaped, never markup.
    assert "&lt;enc.extra&gt; &amp; friends" in page
    assert "<enc.extra>" not in page


def test_the_report_opens_each_trace_once(tmp_path, monkeypatch):
    """The module tree and the origin's plots read through one reader: each trace is opened
    once per page, not once per section."""
    from layerdiff.compare import pair

    opened = []
    real = pair.open_trace

    def counting(path, **options):
        opened.append(Path(path).name)
        return real(path, **options)

    monkeypatch.setattr(pair, "open_trace", counting)
    page = write_html(_failing_diff(tmp_path), tmp_path / "report.html").read_text()
    assert 'id="heatmap"' in page and 'id="module-tree"' in page
    assert sorted(opened) == ["port.h5", "ref.h5"]


def test_passing_report_has_no_heatmap(tmp_path):
    page = write_html(_passing_diff(tmp_path), tmp_path / "report.html").read_text()
    assert "PASS" in page and "FAIL" not in page
    assert 'id="heatmap"' not in page
    assert page.count("data:image/png;base64,") == 1   # the error plot alone


def test_summary_traces_skip_tensor_plots_and_say_so(tmp_path):
    page = write_html(_failing_diff(tmp_path, summary=True), tmp_path / "r.html").read_text()
    assert 'id="heatmap"' not in page
    assert "summary trace" in page
    assert page.count("data:image/png;base64,") == 1


def test_missing_trace_still_gives_a_page(tmp_path):
    diff = _failing_diff(tmp_path)
    diff.port.unlink()
    page = write_html(diff, tmp_path / "report.html").read_text()
    assert "FAIL" in page and "No tensor plots" in page and "does not exist" in page


def test_a_real_browser_draws_the_page(tmp_path, screenshot):
    report = write_html(_failing_diff(tmp_path), tmp_path / "report.html")
    pixels = screenshot(report, 1600)
    assert pixels.shape[:2] == (1600, 1200)
    not_white = (pixels < 0.95).any(axis=2).mean()
    assert not_white > 0.01, f"the page looks blank: {not_white:.2%} of pixels are not white"
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    reddish = ((red > 0.6) & (green < 0.35) & (blue < 0.35)).mean()
    assert reddish > 0.005, f"no red FAIL banner: {reddish:.3%} of pixels are reddish"
    rgb = (pixels * 255).astype(np.int32).reshape(-1, 3)
    # one integer per colour: np.unique over rows of 3 sorts 2 million rows for seconds
    colours = len(np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2]))
    assert colours > 50, f"only {colours} distinct colours: the plots did not render"


def test_a_backward_origins_plots_compare_gradients_at_one_loss_scale(tmp_path, monkeypatch):
    """Traces captured at different --loss-scale: the plotted port gradient is rescaled as the
    diff compared it, so the heatmap shows the bug, not the factor 1024 (a sign flip here:
    the magnitudes agree)."""
    from layerdiff import capture, diff, load_case, load_weights
    from layerdiff.compare.pair import PairReader
    from layerdiff.report import html

    reference = capture(load_case("reference_models.mlp:reference"), tmp_path / "ref.h5",
                        loss_scale=1024.0)
    case = load_case("reference_models.hint_bugs:mlp_sign_backward")
    load_weights(case.model, reference)
    result = diff(reference, capture(case, tmp_path / "port.h5"))
    origin = result.origin
    assert (origin.site, origin.pass_) == ("act1#0", "backward")
    drawn = []
    read = PairReader.read

    def spy(reader, row, **options):  # what the page's origin section draws
        pair = read(reader, row, **options)
        drawn.append(pair)
        return pair

    monkeypatch.setattr(PairReader, "read", spy)
    assert "id=\"heatmap\"" in html.render_html(result)
    ref, port = drawn[0]
    assert np.allclose(np.abs(port), np.abs(ref), rtol=1e-4, atol=1e-9)
