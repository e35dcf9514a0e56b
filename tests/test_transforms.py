"""Transform chains in ``[[param]]`` rules: ``transform = ["concat", "transpose"]`` and the like.

A Flax-style port keeps a fused QKV kernel as ``(in, 3*out)``: the reference's three
``(out, in)`` Linear weights concatenated, then transposed. Checks that such a port loads
through the chain and computes what the reference does; that the diff pairs each reference
weight and weight gradient with its own part of the port's tensor (a wrong part is reported at
that part); that ``["split", "transpose"]`` works the other way round; that the views the diff
takes undo every chain exactly; and that bad chains are refused with the line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, MappingError, capture, diff, load_weights, seed_everything
from layerdiff.compare import result as R
from layerdiff.compare.judge import Verdict
from layerdiff.compare.records import sliced_shape
from layerdiff.mapping import Mapping, ParamSource
from layerdiff.weights import combine, paired_parts

IN, OUT = 4, 6


# ---------------------------------------------------------------- tiny models

class SeparateQKV(nn.Module):
    """The reference: three torch Linears, weights (out, in)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(IN, OUT), nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x) + self.v(x)


class FlaxFusedQKV(nn.Module):
    """A port: one Flax-style kernel (in, 3*out) and a fused bias."""

    def __init__(self, v_grad_scale: float = 1.0) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.zeros(IN, 3 * OUT))
        self.bias = nn.Parameter(torch.zeros(3 * OUT))
        self.v_grad_scale = v_grad_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ self.kernel + self.bias).split(OUT, dim=-1)
        return q * k + _GradScale.apply(v, self.v_grad_scale)


class _GradScale(torch.autograd.Function):
    """Identity forward; a planted bug in backward: the gradient multiplied by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class FusedQKV(nn.Module):
    """A reference with torch's fused layout: one Linear (3*out, in)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(IN, 3 * OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(OUT, dim=-1)
        return q * k + v


class FlaxSeparateQKV(nn.Module):
    """A port of FusedQKV with three Flax-style kernels (in, out)."""

    def __init__(self) -> None:
        super().__init__()
        for name in "qkv":
            self.register_parameter(f"{name}_kernel", nn.Parameter(torch.zeros(IN, OUT)))
        self.bias = nn.Parameter(torch.zeros(3 * OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ getattr(self, f"{n}_kernel") + b
                   for n, b in zip("qkv", self.bias.split(OUT), strict=True))
        return q * k + v


class Net(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.head = nn.Linear(OUT, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _case(attn: nn.Module) -> Case:
    seed_everything(0)
    model = Net(attn)
    x = torch.randn(5, IN)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.pow(2).mean(), seed=0)


FLAX_FUSED_MAP = """
version = 1

[[param]]
port = "attn.kernel"
reference = ["attn.q.weight", "attn.k.weight", "attn.v.weight"]
transform = ["concat", "transpose"]

[[param]]
port = "attn.bias"
reference = ["attn.q.bias", "attn.k.bias", "attn.v.bias"]
transform = "concat"

[[unmatched]]
reference = "attn.*"
why = "the port fuses q, k and v"
"""

FLAX_SPLIT_MAP = """
version = 1

[[param]]
port = ["attn.q_kernel", "attn.k_kernel", "attn.v_kernel"]
reference = "attn.qkv.weight"
transform = ["split", "transpose"]

[[param]]
port = "attn.bias"
reference = "attn.qkv.bias"

[[unmatched]]
reference = "attn.qkv"
why = "the port computes its projections inline"
"""


def _mapping(tmp_path, text: str) -> Mapping:
    path = tmp_path / "map.toml"
    path.write_text(text, encoding="utf-8")
    return Mapping.load(path)


@pytest.fixture
def fused(tmp_path):
    """(reference trace, mapping) for the separate-reference, Flax-fused-port pair."""
    return capture(_case(SeparateQKV()), tmp_path / "ref.h5"), _mapping(tmp_path, FLAX_FUSED_MAP)


def _param_rows(result: R.Diff, role: str):
    rows = result.rows[(result.rows["role"] == role) & (result.rows["site"].str.startswith(
        "attn."))]
    return {(site, arg): row for site, arg, (_, row) in zip(rows["site"], rows["arg"],
                                                           rows.iterrows(), strict=True)}


# ---------------------------------------------------------------- loading and diffing

def test_flax_fused_kernel_loads_through_concat_then_transpose(fused):
    ref_path, mapping = fused
    reference, port = _case(SeparateQKV()).model, _case(FlaxFusedQKV())
    load_weights(reference, ref_path)  # the same weights, read back as the port reads them
    load_weights(port.model, ref_path, mapping)
    attn = reference.attn
    expected = torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]).T
    assert port.model.attn.kernel.shape == (IN, 3 * OUT)
    assert torch.equal(port.model.attn.kernel, expected)
    x = torch.randn(7, IN)
    torch.testing.assert_close(port.model(x), reference(x))


def test_diff_pairs_each_reference_weight_and_gradient_with_its_part(fused, tmp_path):
    ref_path, mapping = fused
    port = _case(FlaxFusedQKV())
    load_weights(port.model, ref_path, mapping)
    result = diff(ref_path, capture(port, tmp_path / "port.h5"), mapping=mapping)
    assert result.passed, result.failing()[["site", "role", "arg", "ratio"]]
    for role in ("weight", "weight_grad"):
        rows = _param_rows(result, role)
        assert set(rows) == {(f"attn.{n}#0", a) for n in "qkv" for a in ("weight", "bias")}
        for (_, arg), row in rows.items():
            assert (row["port_site"], row["port_arg"]) == ("attn#0", "kernel" if arg == "weight"
                                                            else "bias")
            assert row["shape"] == row["port_shape"]
            assert row["verdict"] in (Verdict.WITHIN, Verdict.IDENTICAL)


def test_wrong_part_of_the_fused_weight_is_reported_at_that_part(fused, tmp_path):
    ref_path, mapping = fused
    port = _case(FlaxFusedQKV())
    load_weights(port.model, ref_path, mapping)
    with torch.no_grad():
        port.model.attn.kernel[:, OUT:2 * OUT] += 0.05  # k's columns in the (in, 3*out) layout
    result = diff(ref_path, capture(port, tmp_path / "port.h5"), mapping=mapping)
    verdicts = {key: row["verdict"] for key, row in _param_rows(result, "weight").items()}
    assert verdicts[("attn.k#0", "weight")] == Verdict.OUT
    passing = {Verdict.WITHIN, Verdict.IDENTICAL}
    assert {verdicts[(f"attn.{n}#0", "weight")] for n in "qv"} <= passing
    assert {verdicts[(f"attn.{n}#0", "bias")] for n in "qkv"} <= passing


def test_wrong_gradient_of_one_part_is_reported_at_that_part(fused, tmp_path):
    ref_path, mapping = fused
    port = _case(FlaxFusedQKV(v_grad_scale=2.0))  # v's gradient doubled, the forward exact
    load_weights(port.model, ref_path, mapping)
    result = diff(ref_path, capture(port, tmp_path / "port.h5"), mapping=mapping)
    grads = _param_rows(result, "weight_grad")
    for arg in ("weight", "bias"):
        assert grads[("attn.v#0", arg)]["verdict"] == Verdict.OUT
        assert {grads[(f"attn.{n}#0", arg)]["verdict"] for n in "qk"} <= {Verdict.WITHIN,
                                                                            Verdict.IDENTICAL}
    assert (result.rows.loc[result.rows["pass"] == "forward", "verdict"] != Verdict.OUT).all()


def test_split_then_transpose_loads_and_pairs_each_part(tmp_path):
    ref_path = capture(_case(FusedQKV()), tmp_path / "ref.h5")
    mapping = _mapping(tmp_path, FLAX_SPLIT_MAP)
    reference, port = _case(FusedQKV()).model, _case(FlaxSeparateQKV())
    load_weights(reference, ref_path)
    load_weights(port.model, ref_path, mapping)
    for part, name in enumerate("qkv"):
        expected = reference.attn.qkv.weight[part * OUT:(part + 1) * OUT].T
        assert torch.equal(getattr(port.model.attn, f"{name}_kernel"), expected)
    x = torch.randn(3, IN)
    torch.testing.assert_close(port.model(x), reference(x))
    with torch.no_grad():
        port.model.attn.v_kernel.add_(0.05)
    result = diff(ref_path, capture(port, tmp_path / "port.h5"), mapping=mapping)
    rows = result.rows[(result.rows["site"] == "attn.qkv#0") & (result.rows["arg"] == "weight")
                       & (result.rows["role"] == "weight")]
    assert list(rows["port_arg"]) == ["q_kernel", "k_kernel", "v_kernel"]
    assert list(rows["verdict"] == Verdict.OUT) == [False, False, True]
    assert set(rows["shape"]) == set(rows["port_shape"]) == {f"{OUT},{IN}"}


# ---------------------------------------------------------------- views undo every chain

CHAINS = [("copy",), ("transpose",), ("transpose", "transpose"), ("concat",),
          ("concat", "transpose"), ("transpose", "concat"), ("transpose", "concat", "transpose"),
          ("split",), ("split", "transpose"), ("transpose", "split"), ("copy", "split", "copy")]


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("chain", CHAINS, ids=["+".join(c) for c in CHAINS])
def test_views_undo_the_chain_exactly(chain, axis):
    rng = np.random.default_rng(0)
    if "concat" in chain:  # parts differ in size along the concatenation axis
        flipped = chain[:chain.index("concat")].count("transpose") % 2 == 1
        along = 1 - axis % 2 if flipped else axis % 2
        refs = [rng.standard_normal([rows if d == along else 5 for d in range(2)])
                for rows in (2, 3, 4)]
        sources = [ParamSource(["a", "b", "c"], chain, axis)]
    else:
        refs = [rng.standard_normal((6, 9))]
        parts = 3 if "split" in chain else 1
        sources = [ParamSource(["a"], chain, axis, part, parts) for part in range(parts)]
    for source in sources:
        port = combine(source, refs)
        pairs = paired_parts(source, refs, port)
        assert [name for name, _, _ in pairs] == source.reference
        for (_, ref, part), view in zip(pairs, source.views([r.shape for r in refs], port.shape),
                                        strict=True):
            np.testing.assert_array_equal(part, ref)
            # the shape the diff computes for each side agrees
            assert sliced_shape(port.shape, view.port_slice, view.transpose_port) == ref.shape
        torch_pairs = paired_parts(source, [torch.from_numpy(r) for r in refs],
                                   torch.from_numpy(port))
        for (_, ref, part) in torch_pairs:
            assert torch.equal(part, ref)


def test_plain_and_row_concat_views_stay_streamable():
    """The diff reads these in flat chunks: no transpose, slices along axis 0 only."""
    shapes = [(2, 5), (3, 5)]
    for view in ParamSource(["a", "b"], "concat").views(shapes, (5, 5)):
        assert not view.transpose_port and view.port_slice.axis == 0
    for view in ParamSource(["a", "b"], ["transpose", "concat", "transpose"], 1).views(
            shapes, (5, 5)):  # two transposes cancel: rows of the stored tensor again
        assert not view.transpose_port and view.port_slice.axis == 0


# ---------------------------------------------------------------- the file

def test_single_transform_and_chain_read_the_same(tmp_path):
    one = _mapping(tmp_path, '[[param]]\nport = "a.w"\nreference = "b.w"\n'
                   'transform = "transpose"\n')
    chain = _mapping(tmp_path, '[[param]]\nport = "a.w"\nreference = "b.w"\n'
                     'transform = ["transpose"]\n')
    assert one.param_source("a.w", {}) == chain.param_source("a.w", {}) == ParamSource(
        ["b.w"], "transpose")
    fused = _mapping(tmp_path, FLAX_FUSED_MAP).param_source("attn.kernel", {})
    assert fused.transforms == ("concat", "transpose") and fused.transform == "concat, transpose"


def test_yaml_chain(tmp_path):
    path = tmp_path / "map.yaml"
    path.write_text("param:\n  - port: a.k\n    reference: [b.q, b.k]\n"
                    "    transform: [transpose, concat]\n    axis: 1\n", encoding="utf-8")
    assert Mapping.load(path).param_source("a.k", {}) == ParamSource(
        ["b.q", "b.k"], ("transpose", "concat"), 1)


@pytest.mark.parametrize(("transform", "words"), [
    ('["concat", "permute"]', "transform 'permute' is not one of"),
    ('["concat", "split"]', "at most one"),
    ('["concat", "transpose", "concat"]', "at most one"),
    ("[]", "empty list"),
    ('["concat", 1]', "a name or a list of names"),
    ("3", "a name or a list of names"),
])
def test_bad_chain_names_file_and_line(tmp_path, transform, words):
    path = tmp_path / "map.toml"
    path.write_text(f'version = 1\n\n# fused\n[[param]]\nport = "a.w"\n'
                    f'reference = ["b.q", "b.k"]\ntransform = {transform}\n', encoding="utf-8")
    with pytest.raises(MappingError, match=r"line 4\b") as info:
        Mapping.load(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_chain_sets_how_many_names_each_side_has(tmp_path):
    path = tmp_path / "map.toml"
    path.write_text('[[param]]\nport = "a.w"\nreference = "b.qkv"\n'
                    'transform = ["concat", "transpose"]\n', encoding="utf-8")
    with pytest.raises(MappingError, match="'concat' needs a list of two or more reference"):
        Mapping.load(path)
    path.write_text('[[param]]\nport = ["a.q", "a.k"]\nreference = "b.qk"\n'
                    'transform = ["transpose", "copy"]\n', encoding="utf-8")
    with pytest.raises(MappingError, match="takes one port name, got 2"):
        Mapping.load(path)


def test_concat_axis_outside_the_tensor_is_a_mapping_error(fused, tmp_path):
    ref_path, _ = fused
    port = _case(FlaxFusedQKV())
    mapping = _mapping(tmp_path, FLAX_FUSED_MAP.replace('"transpose"]\n',
                                                        '"transpose"]\naxis = 2\n', 1))
    with pytest.raises(MappingError, match=r"cannot be combined .* axis 2"):
        load_weights(port.model, ref_path, mapping)
    load_weights(port.model, ref_path, _mapping(tmp_path, FLAX_FUSED_MAP))
    port_path = capture(port, tmp_path / "port.h5")
    with pytest.raises(MappingError, match="no axis 2"):
        diff(ref_path, port_path, mapping=mapping)

