"""Conversion functions in ``[[param]]`` chains, and port-only tensors kept as the port's own.

The pair: a reference attention that keeps q/k projection rows in the rotate-half RoPE layout
(as Hugging Face does) and a port that keeps them interleaved per head (as Meta-style ports
do), computing the same function; the port also registers its causal mask as a persistent
buffer the reference does not have. ``to_interleaved`` below is the standard conversion.
Checks that the faithful port loads through it and passes the diff (weights compared as
``f(reference)``, weight gradients pulled back through it); that without it the load is silent
and the diff names the attention; that a port whose permutation is wrong is caught at that
parameter; that map-check applies, reports and checks the function; that a function that
raises is one sentence naming the rule's line; that the port's mask is kept when declared;
that a diff with no function does not import torch; and that a capture records the function's
provenance.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, MappingError, capture, diff, load_weights, seed_everything
from layerdiff.compare import read_pair
from layerdiff.compare.converted import source_warnings
from layerdiff.compare.judge import Verdict
from layerdiff.compare.records import ConvertedParam
from layerdiff.mapping import Mapping, ParamSource
from layerdiff.replay.mapcheck import SUSPICIOUS_CONVERSION, map_check
from layerdiff.report.findings import render
from layerdiff.report.findings.replay import mapcheck_verdict
from layerdiff.trace import open_trace
from layerdiff.weights import combine, paired_parts

HEADS, HEAD_DIM, T = 2, 4, 5
DIM = HEADS * HEAD_DIM
PASSING = {Verdict.WITHIN, Verdict.IDENTICAL}


# ---------------------------------------------------------------- the conversions

def to_interleaved(w: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rows -> Meta's interleaved rows, per head."""
    return w.view(HEADS, 2, HEAD_DIM // 2, -1).transpose(1, 2).reshape(w.shape)


def interleaved_as_one_head(w: torch.Tensor) -> torch.Tensor:
    """A classic wrong one: the interleave with the head count left out (one head of DIM)."""
    return w.view(1, 2, DIM // 2, -1).transpose(1, 2).reshape(w.shape)


def broken(w: torch.Tensor) -> torch.Tensor:
    raise ValueError("head_dim 3 does not divide 8")


def not_a_tensor(w: torch.Tensor):
    return w.numpy()


# ---------------------------------------------------------------- the model pair

def _angles() -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    angles = torch.outer(torch.arange(T).double(), freqs).float()  # (T, HEAD_DIM/2)
    return angles.cos(), angles.sin()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(HEAD_DIM)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshd->bthd", weights, v).flatten(2)


class RotateHalfAttention(nn.Module):
    """The reference (HF layout): rotary pairs (i, i + HEAD_DIM/2) of each head."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        cos, sin = (torch.cat([a, a], -1)[:, None] for a in _angles())
        q, k = (proj(x).view(b, T, HEADS, HEAD_DIM) for proj in (self.q, self.k))
        q, k = (t * cos + torch.cat([-t[..., HEAD_DIM // 2:], t[..., :HEAD_DIM // 2]], -1) * sin
                for t in (q, k))
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        return self.o(_attend(q, k, self.v(x).view(b, T, HEADS, HEAD_DIM), mask))


class InterleavedAttention(nn.Module):
    """The port (Meta layout): rotary pairs (2i, 2i + 1), a causal mask of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        cos, sin = (a[:, None] for a in _angles())
        rotated = []
        for proj in (self.wq, self.wk):
            pairs = proj(x).view(b, T, HEADS, HEAD_DIM // 2, 2)
            even, odd = pairs[..., 0], pairs[..., 1]
            rotated.append(torch.stack([even * cos - odd * sin, even * sin + odd * cos],
                                       -1).flatten(3))
        return self.wo(_attend(*rotated, self.wv(x).view(b, T, HEADS, HEAD_DIM), self.mask))


class FusedInterleavedAttention(InterleavedAttention):
    """The port with q and k fused into one projection, interleaved; ``k_grad_scale`` plants a
    backward bug in k's part alone."""

    k_grad_scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        del self.wq, self.wk
        self.wqk = nn.Linear(DIM, 2 * DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        cos, sin = (a[:, None] for a in _angles())
        q, k = self.wqk(x).split(DIM, -1)
        if self.k_grad_scale != 1.0 and k.requires_grad:
            k.register_hook(lambda g: g * self.k_grad_scale)
        rotated = []
        for t in (q, k):
            pairs = t.view(b, T, HEADS, HEAD_DIM // 2, 2)
            even, odd = pairs[..., 0], pairs[..., 1]
            rotated.append(torch.stack([even * cos - odd * sin, even * sin + odd * cos],
                                       -1).flatten(3))
        return self.wo(_attend(*rotated, self.wv(x).view(b, T, HEADS, HEAD_DIM), self.mask))


class Net(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn, self.head = attn, nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _case(attn: type[nn.Module], name: str = "") -> Case:
    seed_everything(0)
    x = torch.randn(2, T, DIM)  # before the model: a port's init draws other numbers
    model = Net(attn())
    return Case(model=model, inputs=(x,),
                loss_fn=lambda out: out.pow(2).mean(), seed=0, name=name)


def port_case() -> Case:
    return _case(InterleavedAttention, "tests.test_conversions:port_case")


HERE = "tests.test_conversions"


def _map_text(convert: str | None = "to_interleaved", mask: bool = True) -> str:
    chain = f'transform = "{HERE}:{convert}"' if convert else ""
    return f"""version = 1

[[site]]
reference = "attn.v"
port = "attn.wv"

[[site]]
reference = "attn.o"
port = "attn.wo"

[[unmatched]]
reference = "attn.[qk]"
why = "the port keeps its q/k rows interleaved: their outputs are in another layout"

[[unmatched]]
port = "attn.w[qk]"
why = "the port keeps its q/k rows interleaved: their outputs are in another layout"

[[param]]
port = "attn.wq.weight"
reference = "attn.q.weight"
{chain}

[[param]]
port = "attn.wk.weight"
reference = "attn.k.weight"
{chain}
""" + ("""
[[unmatched]]
port = "attn.mask"
why = "the port builds its causal mask itself"
""" if mask else "")


def _mapping(tmp_path: Path, text: str, name: str = "port.map.toml") -> Mapping:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return Mapping.load(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return capture(_case(RotateHalfAttention), tmp_path_factory.mktemp("conv") / "ref.h5")


def _rows(result, role: str, site: str):
    rows = result.rows
    return rows[(rows["role"] == role) & (rows["site"] == site)]


# ---------------------------------------------------------------- loading and diffing

def test_faithful_port_loads_through_the_conversion_and_passes(reference, tmp_path):
    mapping = _mapping(tmp_path, _map_text())
    ref_model, port = _case(RotateHalfAttention).model, port_case()
    load_weights(ref_model, reference)
    report = load_weights(port.model, reference, mapping)
    assert torch.equal(port.model.attn.wq.weight, to_interleaved(ref_model.attn.q.weight))
    x = torch.randn(3, T, DIM)
    torch.testing.assert_close(port.model(x), ref_model(x))
    assert report.kept == {"attn.mask": "the port builds its causal mask itself"}

    result = diff(reference, capture(port, tmp_path / "port.h5"), mapping=mapping)
    assert result.passed, result.failing()[["site", "role", "arg", "ratio", "note"]]
    for site in ("attn.q#0", "attn.k#0"):
        for role in ("weight", "weight_grad"):
            row = _rows(result, role, site).iloc[0]
            assert row["match"] == "converted" and row["verdict"] in PASSING, row
            assert row["port_site"] in ("attn.wq#0", "attn.wk#0")
        grad = _rows(result, "weight_grad", site).iloc[0]
        assert grad["ratio"] < 1e-3 and "pulled back" in grad["note"]
    unmatched = result.unmatched
    mask = unmatched[unmatched["arg"] == "mask"]
    assert not mask.empty and "the port's own" in mask.iloc[0]["reason"]


def test_without_the_conversion_the_load_is_silent_and_the_diff_names_the_attention(
        reference, tmp_path):
    mapping = _mapping(tmp_path, _map_text(convert=None))
    port = port_case()
    load_weights(port.model, reference, mapping)  # the shapes fit: nothing can refuse it
    result = diff(reference, capture(port, tmp_path / "port.h5"), mapping=mapping)
    assert not result.passed
    forward = [o for o in result.origins if o.pass_ == "forward"]
    assert [o.site for o in forward] == ["attn#0"]
    # the weights themselves are as the (wrong) mapping says: only the computation shows it
    assert (_rows(result, "weight", "attn.q#0")["verdict"].isin(PASSING)).all()


def test_a_port_whose_permutation_is_wrong_is_caught_at_that_parameter(reference, tmp_path):
    mapping = _mapping(tmp_path, _map_text())
    port = port_case()
    load_weights(port.model, reference, mapping)
    ref_model = _case(RotateHalfAttention).model
    load_weights(ref_model, reference)
    with torch.no_grad():  # the port's own loader forgot the head count for k
        port.model.attn.wk.weight.copy_(interleaved_as_one_head(ref_model.attn.k.weight))
    result = diff(reference, capture(port, tmp_path / "port.h5"), mapping=mapping)
    assert _rows(result, "weight", "attn.k#0").iloc[0]["verdict"] == Verdict.OUT
    assert _rows(result, "weight", "attn.q#0").iloc[0]["verdict"] in PASSING
    named = {o.site for o in result.origins}
    assert "attn.k#0" in named and "attn.q#0" not in named


def test_a_gradient_wrong_in_one_converted_parameter_is_named_there(reference, tmp_path):
    """The port's weight gradient is compared after its pull-back: a planted backward bug in
    wk's gradient alone is named at attn.k, and wq's stays within."""
    mapping = _mapping(tmp_path, _map_text())
    port = port_case()
    load_weights(port.model, reference, mapping)
    port.model.attn.wk.weight.register_hook(lambda g: g * 1.5)
    result = diff(reference, capture(port, tmp_path / "port.h5"), mapping=mapping)
    assert _rows(result, "weight_grad", "attn.k#0").iloc[0]["verdict"] == Verdict.OUT
    assert _rows(result, "weight_grad", "attn.q#0").iloc[0]["verdict"] in PASSING
    # read back as compared: the port's gradient pulled back to the reference's layout
    row = _rows(result, "weight_grad", "attn.k#0").iloc[0]
    ref, port = read_pair(result, row)
    assert ref.shape == port.shape == tuple(int(n) for n in row["shape"].split(","))
    assert np.abs(port - ref).max() == pytest.approx(row["max_abs"], rel=1e-6)
    assert np.allclose(port, 1.5 * ref, rtol=1e-4, atol=1e-6)


def test_swap_and_replay_judge_the_attention_through_the_conversion(reference, tmp_path):
    """The port's attention swapped into the reference gets its weights through the
    conversion, and its q/k weight gradients are pulled back to the reference's layout."""
    from layerdiff.replay import replay
    from layerdiff.replay.swap import swap

    mapping = _mapping(tmp_path, _map_text())
    result = swap(lambda: _case(RotateHalfAttention), port_case, ["attn"], mapping=mapping)
    assert not result.breaks, [(r.what, r.ratio) for r in result.rows]
    grads = {r.what.split()[1]: r.ratio for r in result.rows if r.what.startswith("weight_grad")}
    assert grads["attn.q.weight"] < 0.1 and grads["attn.k.weight"] < 0.1
    replayed = replay(reference, port_case(), mapping=mapping, propagated=False)
    assert replayed.diff.passed
    assert "attn#0" in set(replayed.diff.rows["site"])


FUSED_MAP = """version = 1

[[site]]
reference = "attn.v"
port = "attn.wv"

[[site]]
reference = "attn.o"
port = "attn.wo"

[[unmatched]]
reference = "attn.[qk]"

[[unmatched]]
port = "attn.wqk"

[[unmatched]]
port = "attn.mask"

[[param]]
port = "attn.wqk.weight"
reference = ["attn.q.weight", "attn.k.weight"]
transform = ["tests.test_conversions:to_interleaved", "concat"]
"""


@pytest.mark.parametrize("k_grad_scale", [1.0, 1.5])
def test_a_fused_converted_gradient_says_which_part_is_off(reference, tmp_path, k_grad_scale):
    """Each reference tensor's gradient is compared with the port's pulled back to it: a
    function-then-concat chain gives a row for q and one for k, and a bug in k's part of the
    fused gradient is named at k alone."""
    mapping = _mapping(tmp_path, FUSED_MAP)
    port = _case(FusedInterleavedAttention)
    load_weights(port.model, reference, mapping)
    port.model.attn.k_grad_scale = k_grad_scale
    result = diff(reference, capture(port, tmp_path / "port.h5"), mapping=mapping)
    verdicts = {site: _rows(result, "weight_grad", site).iloc[0]["verdict"]
                for site in ("attn.q#0", "attn.k#0")}
    weights = _rows(result, "weight", "attn.q#0")
    assert len(weights) == 1 and weights.iloc[0]["port_shape"] == f"{2 * DIM},{DIM}"
    assert weights.iloc[0]["verdict"] in PASSING
    assert verdicts["attn.q#0"] in PASSING
    assert (verdicts["attn.k#0"] == Verdict.OUT) == (k_grad_scale != 1.0)


# ---------------------------------------------------------------- errors and port-only tensors

@pytest.mark.parametrize("function, words", [
    ("broken", ["ValueError", "head_dim 3 does not divide 8"]),
    ("not_a_tensor", ["returned a ndarray", "not a torch.Tensor"])])
def test_a_function_that_fails_is_one_sentence_naming_the_rule(reference, tmp_path, function,
                                                               words):
    mapping = _mapping(tmp_path, _map_text(convert=function))
    with pytest.raises(MappingError) as error:
        load_weights(port_case().model, reference, mapping)
    message = str(error.value)
    assert "port.map.toml line 19" in message and "attn.wq.weight" in message
    assert f"{HERE}:{function}" in message
    assert all(word in message for word in words) and "\n" not in message


def test_a_port_only_buffer_is_refused_unless_declared_the_ports_own(reference, tmp_path):
    port = port_case()
    with pytest.raises(MappingError, match=r"nothing in the reference gives port attn\.mask"):
        load_weights(port.model, reference, _mapping(tmp_path, _map_text(mask=False)))
    with torch.no_grad():
        port.model.attn.mask.fill_(True)  # the port's own value, to see that it is kept
    report = load_weights(port.model, reference, _mapping(tmp_path, _map_text()))
    assert bool(port.model.attn.mask.all())
    assert "attn.mask" not in report.loaded
    assert "kept the port's own: attn.mask (the port builds its causal mask itself)" in \
        report.summary()


# ---------------------------------------------------------------- map-check

def test_map_check_applies_reports_and_checks_the_conversion(reference, tmp_path):
    check = map_check(reference, port_case(), _mapping(tmp_path, _map_text()))
    assert check.passed, render(check)
    entry = next(e for e in check.entries if e.port == "attn.wq.weight")
    digest = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()
    assert entry.functions == [{"function": f"{HERE}:to_interleaved", "source_sha256": digest}]
    assert entry.conversion is not None and entry.conversion["site"] == "attn#0"
    assert entry.conversion["with"] * 1000 < entry.conversion["without"]
    text = render(check)
    assert "to_interleaved()" in text and "2 conversions checked" in " ".join(text.split())
    mask = next(e for e in check.entries if e.port == "attn.mask")
    assert mask.status == "port-own"
    assert json.loads(json.dumps(check.as_json()))["entries"]


def test_map_check_flags_a_conversion_the_port_does_not_need(reference, tmp_path):
    """A port in the reference's own layout, mapped with the conversion: the load without it
    reproduces the attention, the load with it does not."""
    text = _map_text().replace('"attn.wq', '"attn.q').replace('"attn.wk', '"attn.k')
    text = text.replace('"attn.w[qk]"', '"attn.[qk]"').replace(
        '[[site]]\nreference = "attn.v"\nport = "attn.wv"', '').replace(
        '[[site]]\nreference = "attn.o"\nport = "attn.wo"', '')
    text = text.split("[[unmatched]]\nport = \"attn.mask\"")[0]
    check = map_check(reference, _case(RotateHalfAttention), _mapping(tmp_path, text))
    statuses = {e.port: e.status for e in check.entries}
    assert statuses["attn.q.weight"] == SUSPICIOUS_CONVERSION, render(check)
    assert statuses["attn.k.weight"] == SUSPICIOUS_CONVERSION
    assert not check.passed and "worse with their conversion" in mapcheck_verdict(check)


# ---------------------------------------------------------------- gradients, torch, provenance

def test_paired_parts_pulls_a_gradient_back_through_the_chain():
    """A port gradient dL/dp of p = f(w) is J^T dL/dp in the reference's layout: for a
    permutation, its inverse (no weights needed, checked linear); for a nonlinear function
    the weights are needed and used."""
    rng = np.random.default_rng(0)
    grad = torch.from_numpy(rng.standard_normal((DIM, DIM)).astype(np.float32))
    source = ParamSource(["q.weight"], (f"{HERE}:to_interleaved",))
    (name, _, part), = paired_parts(source, [grad], to_interleaved(grad))
    assert name == "q.weight" and torch.equal(part, grad)
    as_numpy = paired_parts(source, [grad.numpy()], to_interleaved(grad).numpy())
    assert np.array_equal(as_numpy[0][2], grad.numpy())

    square = ParamSource(["w"], (f"{HERE}:square",))
    weights = torch.from_numpy(rng.standard_normal((3, 4)))
    port_grad = torch.ones(3, 4, dtype=torch.float64)
    with pytest.raises(MappingError, match="not linear"):
        paired_parts(square, [port_grad], port_grad)
    (_, _, pulled), = paired_parts(square, [port_grad], port_grad, at=[weights])
    torch.testing.assert_close(pulled, 2 * weights)


def square(w: torch.Tensor) -> torch.Tensor:
    return w * w


def test_combine_keeps_the_reference_dtype_and_mixes_with_built_ins():
    parts = [np.arange(DIM * 2, dtype=np.float64).reshape(2, DIM) + 100 * i for i in range(4)]
    source = ParamSource(list("abcd"), ("concat", f"{HERE}:to_interleaved", "transpose"))
    value = combine(source, parts)
    assert value.dtype == np.float64
    expected = to_interleaved(torch.from_numpy(np.concatenate(parts))).T.numpy()
    assert np.array_equal(value, expected)


def test_a_diff_with_no_function_does_not_import_torch(reference, tmp_path):
    mapping = tmp_path / "plain.map.toml"
    mapping.write_text(_map_text(convert=None), encoding="utf-8")
    port = port_case()
    load_weights(port.model, reference, Mapping.load(mapping))
    port_trace = capture(port, tmp_path / "port.h5")
    code = ("import sys, layerdiff; r = layerdiff.diff(sys.argv[1], sys.argv[2], "
            "mapping=sys.argv[3]); assert len(r.rows); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code, str(reference), str(port_trace), str(mapping)],
                   check=True, cwd=Path(__file__).parent.parent)


def test_capture_records_the_conversions_provenance(reference, tmp_path, run):
    mapping = tmp_path / "port.map.toml"
    mapping.write_text(_map_text(), encoding="utf-8")
    out = tmp_path / "port.h5"
    result = run("capture", f"{HERE}:port_case", "--weights-from", reference, "--map", mapping,
                 "-o", out)
    assert result.exit_code == 0, result.output
    assert "kept the port's own: attn.mask" in result.output
    with open_trace(out) as trace:
        recorded = trace.meta["weights"]["conversions"]
        digest = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()
        assert recorded == [{"function": f"{HERE}:to_interleaved", "source_sha256": digest}]
        # code a trace names is never run from the trace: the user passes the file to trust it
        with pytest.raises(MappingError, match=r"line \d+: '.*:to_interleaved' is code, and this "
                           r"mapping was read from port\.h5.*--map port\.map\.toml"):
            diff(reference, out)
        assert diff(reference, out, mapping=mapping).passed
        # a source changed since capture is said
        changed = SimpleNamespace(path=out, meta={"weights": {"conversions": [
            {"function": f"{HERE}:to_interleaved", "source_sha256": "0" * 64}]}})
        item = ConvertedParam(0, ParamSource(["attn.q.weight"], (f"{HERE}:to_interleaved",)),
                              (0,))
        assert source_warnings(trace, [item]) == []
        warning, = source_warnings(changed, [item])
        assert "not the one port.h5 was captured with" in warning and "000000000000" in warning


def test_parts_a_conversion_cannot_join_are_a_shape_problem_not_a_traceback(reference,
                                                                            tmp_path):
    """Parts that do not concatenate after a conversion: a shape mismatch naming the rule's
    tensors, as without one."""
    text = FUSED_MAP.replace('["attn.q.weight", "attn.k.weight"]',
                             '["attn.q.weight", "head.weight"]') + "axis = 1\n"
    with pytest.raises(MappingError, match=r"cannot be combined by .* for port attn\.wqk"):
        load_weights(_case(FusedInterleavedAttention).model, reference,
                     _mapping(tmp_path, text))
