"""The trace browser page: sites in execution order, NaN flagged, per-step norms, summary
traces, the wrong batch elements of a planted batch bug, histograms streamed in bounded chunks,
a self-contained page that a real browser draws.

Besides the bundled CNN and its batch bug, a model of our own: ``Funnel``, whose modules are
declared in an order that is neither their execution order nor alphabetical, with an optional
square root that makes NaN from a negative pre-activation; and ``FunnelPort``, an independent
implementation (matrix products written out) that is right within float32 rounding.
"""

from __future__ import annotations

import json
import re

import h5py
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture, load_case, seed_everything
from layerdiff.errors import OutputError, TraceError
from layerdiff.report.browser import browse, data, write_browser
from layerdiff.report.browser import hist as browser_hist
from layerdiff.trace import TraceWriter, open_trace
from layerdiff.weights import load_weights

BUGGY_CNN = "reference_models.cnn_port:bug_relu_backward_batch"


class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)   # NaN wherever x < 0


class Funnel(nn.Module):
    def __init__(self, nan: bool = False) -> None:
        super().__init__()
        self.alpha = nn.Linear(6, 3)                 # declared first, runs last
        self.zeta = nn.Linear(5, 6)                  # runs first
        self.mid = Sqrt() if nan else nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alpha(self.mid(self.zeta(x)))


class Affine(nn.Module):
    """nn.Linear written out, with the same parameter names."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bi,oi->bo", x, self.weight) + self.bias


class FunnelPort(Funnel):
    def __init__(self) -> None:
        super().__init__()
        self.alpha, self.zeta = Affine(6, 3), Affine(5, 6)


def _funnel(model: nn.Module, steps: int = 1) -> Case:
    seed_everything(0)
    x = torch.randn(4, 5)
    y = torch.tensor([0, 1, 2, 0])
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, y),
                steps=steps, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), name="funnel")


def _funnel_trace(path, *, nan: bool = False, steps: int = 1, summary: bool = False):
    seed_everything(0)
    return capture(_funnel(Funnel(nan), steps), path, summary=summary)


def _self_contained(page: str) -> None:
    """Nothing is fetched: no src or href that leaves the page, no URL at all."""
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:|#)""", page)


@pytest.fixture(scope="module")
def cnn_pair(reference_traces, tmp_path_factory):
    """The CNN reference and its port whose custom ReLU backward uses batch element 0's mask
    for every element, captured as ``layerdiff demo`` does."""
    ref = reference_traces("reference_models.cnn:reference")
    case = load_case(BUGGY_CNN)
    load_weights(case.model, ref, None)
    port = capture(case, tmp_path_factory.mktemp("cnn") / "port.h5")
    return ref, port


def test_sites_in_execution_order_with_histograms_and_norms_per_step(tmp_path):
    trace = _funnel_trace(tmp_path / "funnel.h5", steps=3)
    calls: list[tuple[int, int]] = []
    result = browse(trace, progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1][0] == calls[-1][1] > 0      # histogram reads, to the end
    # execution order: not the declaration order (alpha, zeta, mid), not alphabetical
    assert result.sites == ["<root>#0", "zeta#0", "mid#0", "alpha#0", "<loss>#0"]
    page = result.html
    table = page[page.index('id="sites"'):page.index('id="histograms"')]
    positions = [table.index(f">{site}<") for site in ("zeta#0", "mid#0", "alpha#0")]
    assert positions == sorted(positions)
    # a small trace: every site's histograms, linked from its row
    assert result.histograms == result.sites
    assert page.count('class="chart hist"') == len(result.sites)
    assert 'href="#hist-2"' in page and 'id="hist-2"' in page
    # norms per layer and per step: SGD moves the weights, so step 2's differ from step 0's
    norms = result.norms.set_index(["step", "module"])
    assert sorted(result.norms["step"].unique()) == [0, 1, 2]
    assert set(result.norms["module"]) == {"zeta", "alpha"}     # mid (Tanh) has no weights
    assert norms.loc[(0, "zeta"), "weight"] != norms.loc[(2, "zeta"), "weight"]
    assert (result.norms["grad"] > 0).all()
    assert not result.found and "No NaN or Inf" in page
    _self_contained(page)


def test_a_nan_record_is_flagged_where_it_first_appears(tmp_path):
    trace = _funnel_trace(tmp_path / "nan.h5", nan=True)
    result = browse(trace)
    assert result.found
    first = result.nonfinite[0]
    assert (first.site, first.pass_, first.role, first.step) == ("mid#0", "forward", "output", 0)
    assert first.nan > 0
    page = result.html
    assert "NaN/Inf</span>" in page                          # the banner
    assert "First non-finite record in the reference: <b>mid#0, forward output" in page
    table = page[page.index('id="sites"'):page.index('id="histograms"')]
    flagged = re.findall(r'<tr class="nonfinite">.*?</tr>', table)
    mid = next(row for row in flagged if ">mid#0<" in row)
    assert "out NaN" in mid
    # zeta's output is finite; the NaN reaches it only as the gradient, in the backward pass
    zeta = next(row for row in flagged if ">zeta#0<" in row)
    assert "grad NaN" in zeta and "out NaN" not in zeta
    assert "mid#0" in result.format() and "non-finite" in result.format()
    # the NaN reaches every weight gradient: both layers' gradient norms are flagged
    norms = result.norms.set_index("module")
    assert norms["grad_bad"].all() and not norms["weight_bad"].any()
    chart = page[page.index('id="norms"'):page.index('id="sites"')]
    assert chart.count(">not finite<") == 2
    _self_contained(page)


def test_summary_trace_works_from_the_index_and_says_histograms_need_data(tmp_path):
    trace = _funnel_trace(tmp_path / "summary.h5", summary=True, steps=2)
    result = browse(trace)
    assert result.summary and result.histograms == []
    page = result.html
    assert "histograms need a full trace" in page
    assert 'id="ranges-0"' in page and 'id="norms"' in page
    ranges = data.site_ranges(open_trace(trace), 0).set_index("site")
    assert ranges.loc["mid#0", "out_max"] <= 1.0 and ranges.loc["mid#0", "out_min"] >= -1.0
    # a pair of summary traces: the diff compares statistics, and there is no batch image
    pair = browse(trace, against=trace)
    assert pair.verdict == "pass" and pair.batch is None
    assert "summary trace holds statistics only" in pair.html
    # --site on a summary trace is still checked, and still draws nothing
    assert browse(trace, sites=["mid"]).histograms == []
    _self_contained(page)


def test_pair_marks_the_wrong_batch_elements_of_a_planted_batch_bug(cnn_pair, tmp_path):
    ref, port = cnn_pair
    result = browse(ref, against=port, sites=["block.act"])
    assert result.found and result.verdict == "fail"
    batch = result.batch
    assert batch is not None and batch.batch == 8
    assert batch.origin is not None
    assert (batch.origin.site, batch.origin.role, batch.origin.pass_) == (
        "block.act#0", "grad_input", "backward")
    assert batch.wrong == [1, 2, 3, 4, 5, 6, 7]             # every element but the first
    assert batch.origin.ratios[0] <= 1.0
    # forward is right for every element; identical records (never read) count as right
    assert batch.rows[0].label() == "stem#0 output" and batch.rows[0].ratios == [0.0] * 8
    assert all(not row.wrong for row in batch.rows if row.pass_ == "forward")
    page = result.html
    assert re.search(r"<b>block\.act#0 grad_input</b> \(backward\): batch element\(s\) "
                     r"<b>1–7</b> of 0–7 are out of tolerance; 0 within", page)
    assert 'id="batch-image"' in page
    assert result.histograms == ["block.act#0"]
    assert "1–7 of 0–7" in result.format()
    assert json.loads(json.dumps(result.as_json(), allow_nan=False))["batch"]["wrong"] == [
        1, 2, 3, 4, 5, 6, 7]
    _self_contained(page)


def test_a_correct_port_of_our_own_shows_no_wrong_batch_element(tmp_path):
    ref = _funnel_trace(tmp_path / "ref.h5")
    port_model = FunnelPort()
    load_weights(port_model, ref, None)
    port = capture(_funnel(port_model), tmp_path / "port.h5")
    result = browse(ref, against=port)
    assert result.verdict == "pass" and not result.found
    assert result.batch is not None and result.batch.wrong == [] and result.batch.batch == 4
    assert "Every batch element (0–3) is within tolerance" in result.html
    # the port's ranges are drawn beside the reference's, under the reference's site names
    assert "reference (blue) and port (orange)" in result.html
    # a port trace without one of the sites: a gap, not a NaN flag
    partial = capture(_funnel(port_model), tmp_path / "partial.h5", exclude=["mid"])
    gap = browse(ref, against=partial)
    assert not gap.nonfinite and 'fill-opacity="0.18"' not in gap.html
    assert ">not finite<" not in gap.html


def test_histograms_stream_in_chunks_and_match_numpy(tmp_path):
    rng = np.random.default_rng(1)
    big = rng.standard_normal((3, 200_000)).astype(np.float32)   # 2.4 MB: three chunks
    big[1, 7] = np.nan
    small = (rng.standard_normal(300_000) * 1e-4).astype(np.float32)  # all finite: fast path
    with TraceWriter(tmp_path / "t.h5") as w, w.site("layer", "Layer") as site:
        w.record(site, "output", big)
        w.record(site, "grad_output", small)
    with open_trace(tmp_path / "t.h5") as trace:
        for n, values, nan in ((0, big, 1), (1, small, 0)):
            row = trace.index.iloc[n]
            edges = data.bin_edges([(row, 1.0)])
            counts, hidden = data.histogram(data.TensorStream(trace), row, edges, 1.0)
            finite = values[np.isfinite(values)].astype(np.float64)
            assert hidden == nan
            assert counts.tolist() == np.histogram(finite, bins=edges)[0].tolist()
    # what is read is checked against the index digest: a damaged byte is refused
    with h5py.File(tmp_path / "t.h5", "r+") as h5:
        segment = h5["tensors"][sorted(h5["tensors"])[0]]
        segment[100] = segment[100] ^ 0xFF
    with open_trace(tmp_path / "t.h5") as trace, pytest.raises(TraceError, match="digest"):
        row = trace.index.iloc[0]
        data.histogram(data.TensorStream(trace), row, data.bin_edges([(row, 1.0)]), 1.0)


def test_large_traces_draw_histograms_only_for_named_sites(tmp_path, monkeypatch):
    trace = _funnel_trace(tmp_path / "funnel.h5")
    monkeypatch.setattr(browser_hist, "HIST_BUDGET_BYTES", 64)
    result = browse(trace)
    assert result.histograms == []
    assert any("--site" in note and "budget" in note for note in result.notes)
    assert "What this page leaves out" in result.html
    assert browse(trace, sites=["mid"]).histograms == ["mid#0"]     # a module path matches
    assert browse(trace, sites=["z*#0", "alpha#0"]).histograms == ["zeta#0", "alpha#0"]


def test_bad_input_gives_one_sentence(tmp_path):
    trace = _funnel_trace(tmp_path / "funnel.h5")
    with pytest.raises(TraceError, match=r"no site at step 0 matches --site nope\*"):
        browse(trace, sites=["nope*"])
    with pytest.raises(TraceError, match="has no step 5"):
        browse(trace, step=5)
    before = trace.read_bytes()
    with pytest.raises(OutputError, match="is the trace this command reads"):
        write_browser(trace, trace)
    assert trace.read_bytes() == before
    page = write_browser(trace, tmp_path / "missing" / "page.html")  # folders are created
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    with pytest.raises(TraceError, match="does not exist"):
        browse(tmp_path / "absent.h5")


def test_a_real_browser_draws_the_page(cnn_pair, tmp_path, screenshot):
    ref, port = cnn_pair
    page = write_browser(ref, tmp_path / "browser.html", against=port)
    pixels = screenshot(page, 2400)
    assert pixels.shape[:2] == (2400, 1200)
    not_white = (pixels < 0.95).any(axis=2).mean()
    assert not_white > 0.05, f"the page looks blank: {not_white:.2%} of pixels are not white"
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    reddish = ((red > 0.6) & (green < 0.35) & (blue < 0.35)).mean()
    assert reddish > 0.005, f"no red FAIL banner or red cells: {reddish:.3%} are reddish"
    # one integer per colour: np.unique over rows of 3 sorts 3 million rows for seconds
    rgb = (pixels * 255).astype(np.uint32).reshape(-1, 3)
    colours = len(np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2]))
    assert colours > 50, f"only {colours} distinct colours: the images did not render"


def test_show_html_writes_the_page_and_exits_by_what_it_found(cnn_pair, tmp_path, run):
    ref, port = cnn_pair
    alone = run("show", ref, "--html", tmp_path / "ref.html")
    assert alone.exit_code == 0, alone.output  # a clean trace: nothing found
    assert (tmp_path / "ref.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    pair = run("show", ref, "--html", tmp_path / "pair.html", "--against", port)
    assert pair.exit_code == 1, pair.output
    assert "wrong batch elements at block.act#0 grad_input: 1–7 of 0–7" in pair.output
    refused = run("show", ref, "--html", port, "--against", port)
    assert refused.exit_code == 2 and "would destroy" in refused.output
    assert run("show", ref, "--against", port).exit_code == 2  # --against needs --html
