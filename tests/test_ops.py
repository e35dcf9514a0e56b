"""Op-level capture (``--ops``): op sites inside a module's own code, recorded without changing
the run, paired inside their module pair, and origins named at the op, forward and backward."""

from __future__ import annotations

import shlex

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, capture, diff, load_case, load_weights, open_trace
from layerdiff.capture.ops import op_name
from layerdiff.errors import CaptureError
from layerdiff.trace import schema
from reference_models import op_bugs
from reference_models.catalog import CATALOG

REFERENCE = f"{op_bugs.MODULE}:reference"
OP_BUGS = [info for info in CATALOG if info.op_site]


def _port(spec_or_case, reference, path, **options):
    """``capture PORT --weights-from REF``: the port given the reference trace's weights."""
    case = load_case(spec_or_case) if isinstance(spec_or_case, str) else spec_or_case
    load_weights(case.model, reference, None)
    return capture(case, path, **options)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return capture(load_case(REFERENCE), tmp_path_factory.mktemp("ops") / "ref.h5", ops=["*"])


# ---- capture


def test_op_sites_nest_under_the_module_call_whose_own_code_runs_them(tmp_path):
    path = capture(load_case(REFERENCE), tmp_path / "t.h5", ops=["blocks.0.attn"])
    with open_trace(path) as trace:
        sites = trace.sites[trace.sites["step"] == 0]
        ops = sites[[schema.is_op_site(s) for s in sites["site"]]]
        meta = trace.meta
    # only the attention's own code: its qkv and proj children run F.linear, not recorded
    assert set(ops["parent"]) == {"blocks.0.attn#0"}
    assert list(ops.sort_values("enter_seq")["site"]) == [
        f"blocks.0.attn#0/{op}" for op in
        ("matmul#0", "mul#0", "masked_fill#0", "softmax#0", "matmul#1")]
    assert (ops["type"] == [schema.split_op_site(s)[1] for s in ops["site"]]).all()
    assert meta["ops"] == {"globs": ["blocks.0.attn"], "modules": ["blocks.0.attn"],
                           "all": False}


def test_views_are_skipped_unless_asked_for(tmp_path):
    path = capture(load_case(REFERENCE), tmp_path / "t.h5", ops=["blocks.0.attn"],
                   ops_all=True)
    with open_trace(path) as trace:
        names = {schema.split_op_site(s)[1] for s in trace.sites["site"]
                 if schema.is_op_site(s)}
    assert {"view", "transpose", "split", "getitem"} <= names
    assert not names & {"__get__", "empty"}  # attributes and uninitialised memory never


def test_capture_with_ops_records_the_same_values_as_without(reference, tmp_path):
    plain = capture(load_case(REFERENCE), tmp_path / "plain.h5")
    with open_trace(plain) as a, open_trace(reference) as b:
        modules = b.index[[not schema.is_op_site(s) for s in b.index["site"]]]
        keys = ["step", "site", "role", "arg"]
        left = a.index.set_index(keys)["digest"].sort_index()
        right = modules.set_index(keys)["digest"].sort_index()
    assert len(left) == len(right) and (left == right).all()


def test_custom_autograd_function_is_one_op_with_its_true_gradient(reference):
    site = "blocks.1.mlp#0/SquaredReLU#0"
    with open_trace(reference) as trace:
        rows = trace.index[(trace.index["site"] == site) & (trace.index["step"] == 0)]
        get = {role: trace.read(rows[rows["role"] == role].iloc[0])
               for role in ("input", "output", "grad_output", "grad_input")}
        inner = [s for s in trace.sites["site"] if s.startswith("blocks.1.mlp#0/")]
    assert set(inner) == {site}  # the relu and pow of its forward are its own, not recorded
    x = torch.from_numpy(get["input"])
    np.testing.assert_allclose(get["output"], (x.relu() ** 2).numpy(), rtol=1e-6)
    np.testing.assert_allclose(get["grad_input"], get["grad_output"] * 2 * x.relu().numpy(),
                               rtol=1e-5, atol=1e-12)


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(3.0)          # in place on a tensor that needs grad
        h[:, 0] = 0.0        # and an indexed write
        return h


def _tiny_case(model: nn.Module) -> Case:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0,
                steps=1, name="tests.tiny")


def test_in_place_op_records_its_input_before_it_runs_and_its_gradient(tmp_path):
    torch.manual_seed(0)
    path = capture(_tiny_case(_InPlace()), tmp_path / "t.h5", ops=["<root>"])
    with open_trace(path) as trace:
        index = trace.index

        def read(site, role):
            return trace.read(index[(index["site"] == site) & (index["role"] == role)].iloc[0])

        before, after = read("<root>#0/mul_#0", "input"), read("<root>#0/mul_#0", "output")
        written = read("<root>#0/setitem#0", "output")
        grad_out = read("<root>#0/mul_#0", "grad_output")
        grad_in = read("<root>#0/mul_#0", "grad_input")
    np.testing.assert_allclose(after, 3 * before, rtol=1e-6)
    assert (written[:, 0] == 0).all() and (written[:, 1:] == after[:, 1:]).all()
    np.testing.assert_allclose(grad_in, 3 * grad_out, rtol=1e-6)


@pytest.mark.parametrize(("func", "name"), [
    (torch.Tensor.__add__, "add"), (torch.Tensor.__radd__, "add"),
    (torch.Tensor.__iadd__, "add_"), (torch.Tensor.__truediv__, "div"),
    (torch.Tensor.__rtruediv__, "div"), (torch.Tensor.__matmul__, "matmul"),
    (torch.Tensor.__getitem__, "getitem"), (torch.softmax, "softmax"),
    (torch.nn.functional.scaled_dot_product_attention, "scaled_dot_product_attention")])
def test_operators_are_named_as_their_functions(func, name):
    assert op_name(func) == name


def test_ops_glob_errors_name_the_fix(tmp_path):
    with pytest.raises(CaptureError, match=r"--ops 'blocks\.9\.\*' matches no module"):
        capture(load_case(REFERENCE), tmp_path / "a.h5", ops=["blocks.9.*"])
    with pytest.raises(CaptureError, match="leave out"):
        capture(load_case(REFERENCE), tmp_path / "b.h5", ops=["blocks.0.attn"],
                exclude=["blocks.0.attn"])
    assert not (tmp_path / "a.h5").exists() and not (tmp_path / "b.h5").exists()


# ---- diff: pairing and origins at the op


@pytest.mark.parametrize("info", OP_BUGS, ids=[i.spec.rpartition(":")[2] for i in OP_BUGS])
def test_bug_in_a_modules_own_code_is_found_at_the_op(info, reference, tmp_path):
    module = info.site.rpartition("#")[0]
    port = _port(info.spec, reference, tmp_path / "p.h5", ops=["*"])
    result = diff(reference, port)
    origin = result.origin
    assert (origin.site, origin.pass_, origin.step) == (info.op_site, info.pass_, 0)
    assert len(result.origins) == 1
    assert info.site in origin.holders           # its module holds it
    # only the module's own ops: the same bug
    narrow_ref = capture(load_case(REFERENCE), tmp_path / "r1.h5", ops=[module])
    narrow = _port(info.spec, narrow_ref, tmp_path / "p1.h5", ops=[module])
    assert diff(narrow_ref, narrow).origin.site == info.op_site


def test_terminal_report_nests_op_rows_under_their_module(reference, tmp_path):
    from layerdiff.report.terminal import format_diff

    port = _port(f"{op_bugs.MODULE}:bug_softmax_axis", reference, tmp_path / "p.h5",
                 ops=["*"])
    lines = format_diff(diff(reference, port), verbose=True).splitlines()
    assert max(len(line) for line in lines) <= 100
    table = [line for line in lines if line.startswith("   0 fwd")]
    # after a child's rows an op shows in full; the rows after it, of the same call's ops, nest
    first = next(i for i, line in enumerate(table) if " blocks.0.attn#0/matmul#0 " in line)
    rows = table[first + 1:first + 10]
    assert all("  └ " in line for line in rows)
    assert list(dict.fromkeys(line.split()[3] for line in rows)) == [
        "matmul#0", "mul#0", "masked_fill#0", "softmax#0"]


def test_sdpa_port_passes_with_ops(reference, tmp_path):
    port = _port(f"{op_bugs.MODULE}:port", reference, tmp_path / "p.h5", ops=["*"])
    result = diff(reference, port)
    assert result.passed, result.failing()[["site", "role", "ratio"]].head()
    # the fused call pairs as a group with the five ops it stands for (test_op_pairing.py)
    paired = {p["reference"]: p["port"] for p in result.meta["op_pairings"]}
    assert paired["blocks.0.attn#0/softmax#0"] == "blocks.0.attn#0/scaled_dot_product_attention#0"
    compared = set(result.rows["site"])
    assert "blocks.0.attn#0" in compared  # the module's own output is still compared
    assert "blocks.1.mlp#0/SquaredReLU#0" in compared


class _ScaleFirst(op_bugs.Attention):
    """Correct, in another order: q is scaled before q @ k^T (as many ports do), so the
    matmul and mul op sites pair by name and shape but hold other intermediate values."""

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, op_bugs.HEADS, op_bugs.HEAD).transpose(1, 2)
                   for t in (q, k, v))
        scores = (q * self.scale) @ k.transpose(-2, -1)
        scores = scores.masked_fill(self.future[:length, :length], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


def test_a_correct_port_with_other_intermediate_values_passes(reference, tmp_path):
    case = load_case(REFERENCE)
    for block in case.model.blocks:
        block.attn.__class__ = _ScaleFirst
    result = diff(reference, _port(case, reference, tmp_path / "p.h5", ops=["*"]))
    assert result.passed and not result.origins
    excused = result.rows[result.rows["verdict"] == "module-within"]
    # the matmul of scaled q is not the reference's matmul: told, not failed
    assert "blocks.0.attn#0/matmul#0" in set(excused["site"])
    assert (excused["ratio"] > 1).all()
    assert excused["note"].str.contains("other intermediate values").all()


def test_ops_captured_on_one_side_only_say_so(reference, tmp_path):
    port = _port(f"{op_bugs.MODULE}:port", reference, tmp_path / "p.h5")
    result = diff(reference, port)
    assert result.passed
    lone = result.unmatched.set_index("site")["reason"]
    assert "capture the port with --ops 'blocks.0.attn' too" in lone["blocks.0.attn#0/softmax#0"]


def test_mapping_pairs_op_sites_explicitly(reference, tmp_path):
    port = _port(f"{op_bugs.MODULE}:port", reference, tmp_path / "p.h5", ops=["*"])
    mapping = tmp_path / "m.toml"
    # the weighted sum's output is the fused call's; of the inputs, v is its third argument
    # and the attention probabilities are not in the port at all
    mapping.write_text('version = 1\n[[pair]]\nreference = "blocks.0.attn#0/matmul#1"\n'
                       'port = "blocks.0.attn#0/scaled_dot_product_attention#0"\n'
                       'args = { "0" = "", "1" = "2" }\n')
    result = diff(reference, port, mapping=mapping)
    rows = result.rows[result.rows["site"] == "blocks.0.attn#0/matmul#1"]
    assert set(rows["port_site"]) == {"blocks.0.attn#0/scaled_dot_product_attention#0"}
    assert set(zip(rows["role"], rows["arg"], rows["port_arg"], strict=True)) >= {
        ("output", "0", "0"), ("input", "1", "2"), ("grad_input", "1", "2")}
    assert result.passed


def test_module_origin_suggests_the_captures_that_name_the_op(run, tmp_path):
    """The diff of module-level traces ends with commands; run as printed, they name the op."""
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    assert run("capture", REFERENCE, "-o", ref).exit_code == 0
    assert run("capture", f"{op_bugs.MODULE}:bug_softmax_axis", "-o", port,
               "--weights-from", ref).exit_code == 0
    result = run("diff", ref, port, "--html", tmp_path / "d.html")
    assert result.exit_code == 1
    assert "FAIL  origin: blocks.0.attn#0, forward output" in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 100
    page = (tmp_path / "d.html").read_text()
    assert "Look inside the module" in page and "--ops blocks.0.attn" in page
    text = result.output.split("name the op:\n", 1)[1]
    commands = [shlex.split(c) for c in text.replace("\\\n", " ").splitlines() if c.strip()]
    assert [c[:2] for c in commands] == [["layerdiff", "capture"]] * 2 + [["layerdiff", "diff"]]
    assert commands[0][5:7] == ["--ops", "blocks.0.attn"]
    for command in commands[:2]:
        assert run(*command[1:]).exit_code == 0
    named = run(*commands[2][1:])
    assert named.exit_code == 1
    assert "FAIL  origin: blocks.0.attn#0/softmax#0, forward output" in named.output
    assert "name the op" not in named.output  # the ops are captured: nothing more to suggest


# ---- a port of our own, outside the zoo: Gemma-2 style soft-capping in a block's own code


class _Block(nn.Module):
    def __init__(self, cap: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.cap = cap

    def forward(self, x):
        h = self.mlp(self.norm(x))
        h = self.cap * torch.tanh(h / self.cap)   # soft cap: the port took another constant
        return (x + h).to(x.dtype)


def _block_case(cap: float) -> Case:
    torch.manual_seed(1)
    model = nn.Sequential(_Block(30.0), _Block(cap), nn.Linear(16, 3))
    x = torch.randn(6, 5, 16) * 20
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=1,
                steps=1, name="tests.softcap_block")


def test_a_wrong_constant_in_a_blocks_own_code_is_named_at_its_op(tmp_path):
    ref = capture(_block_case(30.0), tmp_path / "ref.h5", ops=["*"])
    port = _port(_block_case(50.0), ref, tmp_path / "port.h5", ops=["*"])
    result = diff(ref, port)
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role) == ("1#0/div#0", "forward", "output")
    assert origin.holders == ["1#0", "<root>#0"] or set(origin.holders) == {"1#0", "<root>#0"}
    assert origin.hint is not None and origin.hint["kind"] == "scale"
    # module-level capture: the block, in its own code, and the commands to look inside
    ref_m = capture(_block_case(30.0), tmp_path / "ref_m.h5")
    port_m = _port(_block_case(50.0), ref_m, tmp_path / "port_m.h5")
    coarse = diff(ref_m, port_m)
    assert coarse.origin.site == "1#0"
    assert coarse.meta["ops_commands"] == []  # a case built in a test has no spec to re-run
