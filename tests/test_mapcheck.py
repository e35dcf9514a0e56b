"""``map_check``: the dry run of a mapping, on tiny models defined here.

A correct mapping passes; a forgotten parameter is listed without source and fails; a
reference tensor nothing uses is listed; a square weight loaded the wrong way round (a missing
or an extra ``transpose``: the shapes fit either way) is flagged at that parameter by running
its module on the reference's recorded inputs; a shape that does not fit is an entry, not an
exception; the port model is left as it was; bad input is refused with a sentence.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from layerdiff import (
    Case,
    CaseError,
    MappingError,
    TraceError,
    capture,
    load_weights,
    seed_everything,
)
from layerdiff.replay.mapcheck import MapCheck, map_check
from layerdiff.report.findings import render
from tests.tiny_cases import numpy_port

WIDTH = 5


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)         # square: fits transposed too
        self.proj = nn.Linear(WIDTH, 3)
        self.register_buffer("table", torch.arange(4.0))  # the port has no use for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.lin(x)))


class Dense(nn.Module):
    """A Flax-style dense layer: kernel (in, out), y = x @ kernel + bias."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.kernel + self.bias


class Port(nn.Module):
    def __init__(self, dense: bool = False) -> None:
        super().__init__()
        self.inner = Dense(WIDTH, WIDTH) if dense else nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(x)))


def _case(model: nn.Module) -> Case:
    return Case(model=model, inputs=(torch.randn(4, WIDTH),), loss_fn=lambda o: o.pow(2).mean(),
                name="tests.test_mapcheck:port")


SITES = """version = 1

[[site]]
reference = "lin"
port = "inner"

[[site]]
reference = "proj"
port = "out"
"""

DENSE_KERNEL = """
[[param]]
port = "inner.kernel"
reference = "lin.weight"
transform = "transpose"
"""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    seed_everything(0)
    case = Case(model=Reference(), inputs=(torch.randn(6, WIDTH),),
                loss_fn=lambda o: o.pow(2).mean())
    return capture(case, tmp_path_factory.mktemp("mapcheck") / "ref.h5")


def _map(tmp_path, text: str):
    path = tmp_path / "port.map.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _entry(check: MapCheck, port: str):
    return next(entry for entry in check.entries if entry.port == port)


def _statuses(check: MapCheck) -> dict[str, str]:
    return {entry.port: entry.status for entry in check.entries}


def test_correct_mapping_passes(reference, tmp_path):
    check = map_check(reference, _case(Port()), _map(tmp_path, SITES))
    assert check.passed and bool(check)
    assert _statuses(check) == dict.fromkeys(
        ["inner.weight", "inner.bias", "out.weight", "out.bias"], "ok")
    assert _entry(check, "inner.weight").reference == ["lin.weight"]
    assert _entry(check, "out.bias").transform == ("copy",)
    declared, transposed = _entry(check, "inner.weight").errors  # square: checked, and fine
    assert declared < 1e-5 < transposed
    assert render(check).splitlines()[-1].startswith("PASS")


def test_flax_dense_with_its_transpose_passes(reference, tmp_path):
    check = map_check(reference, _case(Port(dense=True)), _map(tmp_path, SITES + DENSE_KERNEL))
    assert check.passed, render(check)
    entry = _entry(check, "inner.kernel")
    assert (entry.reference, entry.transform, entry.status) == (["lin.weight"], ("transpose",),
                                                                "ok")


def test_forgotten_parameter_is_listed_without_source_and_fails(reference, tmp_path):
    without_out = SITES[:SITES.index('[[site]]\nreference = "proj"')]
    check = map_check(reference, _case(Port()), _map(tmp_path, without_out))
    assert not check.passed and not check
    assert _statuses(check) == {"inner.weight": "ok", "inner.bias": "ok",
                                "out.weight": "no-source", "out.bias": "no-source"}
    assert "proj.weight" in check.unused_reference
    text = render(check)
    assert "out.weight" in text and text.splitlines()[-1].startswith("FAIL")
    assert "2 without a source" in text.splitlines()[-1]


def test_reference_tensor_nothing_uses_is_listed(reference, tmp_path):
    check = map_check(reference, _case(Port()), _map(tmp_path, SITES))
    assert check.unused_reference == ["table"]
    assert check.passed  # an unused reference tensor (a lookup table) is not a fault
    assert "nothing uses (1): table" in render(check)


@pytest.mark.parametrize(("dense", "rule"), [
    (False, '[[param]]\nport = "inner.weight"\nreference = "lin.weight"\n'
            'transform = "transpose"\n'),                                    # an extra transpose
    (True, '[[param]]\nport = "inner.kernel"\nreference = "lin.weight"\n'),  # a missing one
], ids=["extra-transpose", "missing-transpose"])
def test_square_weight_loaded_the_wrong_way_round_is_suspicious(reference, tmp_path, dense,
                                                                rule):
    check = map_check(reference, _case(Port(dense)), _map(tmp_path, SITES + rule))
    name = "inner.kernel" if dense else "inner.weight"
    assert not check.passed
    assert [e.port for e in check.failing()] == [name]
    entry = _entry(check, name)
    assert entry.status == "suspicious-transpose"
    assert "lin#0" in entry.note and "transpose" in entry.note
    declared, transposed = entry.errors
    assert transposed * 10 < declared
    assert "1 likely transposed" in render(check).splitlines()[-1]


def test_shape_mismatch_is_an_entry_not_an_exception(reference, tmp_path):
    rule = '[[param]]\nport = "out.weight"\nreference = "lin.weight"\n'
    check = map_check(reference, _case(Port()), _map(tmp_path, SITES + rule))
    entry = _entry(check, "out.weight")
    assert entry.status == "shape-mismatch"
    assert "(3, 5)" in entry.note and "(5, 5)" in entry.note
    assert not check.passed
    assert "proj.weight" in check.unused_reference
    with pytest.raises(MappingError, match=r"out\.weight has shape"):  # what it protects from
        load_weights(Port(), reference, _map(tmp_path, SITES + rule))


def test_a_shape_that_fits_transposed_says_so(reference, tmp_path):
    rule = ('[[param]]\nport = "out.weight"\nreference = "proj.weight"\n'
            'transform = "transpose"\n')
    check = map_check(reference, _case(Port()), _map(tmp_path, SITES + rule))
    entry = _entry(check, "out.weight")
    assert entry.status == "shape-mismatch" and "transposed it would fit" in entry.note


def test_square_weight_whose_module_has_no_partner_is_not_checked(reference, tmp_path):
    rule = '[[param]]\nport = "inner.weight"\nreference = "lin.weight"\n'
    rules = (rule + '[[param]]\nport = "inner.bias"\nreference = "lin.bias"\n'
             + SITES[SITES.index('[[site]]\nreference = "proj"'):])
    check = map_check(reference, _case(Port()), _map(tmp_path, "version = 1\n" + rules))
    entry = _entry(check, "inner.weight")
    assert entry.status == "not-checked" and "no reference site pairs" in entry.note
    assert check.passed  # not checked is said, not failed


def test_model_is_left_as_it_was(reference, tmp_path):
    case = _case(Port(dense=True))
    before = {name: t.clone() for name, t in case.model.state_dict().items()}
    map_check(reference, case, _map(tmp_path, SITES + DENSE_KERNEL))
    after = case.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_json_and_text_reports(reference, tmp_path):
    rule = '[[param]]\nport = "out.weight"\nreference = "lin.weight"\n'
    check = map_check(reference, _case(Port()), _map(tmp_path, SITES + rule))
    report = json.loads(json.dumps(check.as_json()))  # plain JSON types only
    assert report["verdict"] == "fail" and report["unused_reference"] == ["proj.weight", "table"]
    assert {e["port"]: e["status"] for e in report["entries"]}["out.weight"] == "shape-mismatch"
    assert set(report["entries"][0]) >= {"port", "reference", "transform", "status", "note"}
    text = render(check)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert text.splitlines()[0].split() == ["port", "tensor", "from", "transform", "status"]


def test_long_names_fit_100_columns(tmp_path):
    deep = nn.Sequential()
    deep.add_module("a_rather_long_module_name_for_an_encoder_block_number_zero",
                    nn.Linear(3, 3))
    seed_everything(0)
    path = capture(Case(model=deep, inputs=(torch.randn(2, 3),), loss_fn=lambda o: o.sum()),
                   tmp_path / "ref.h5")
    port = nn.Sequential()
    port.add_module("a_rather_long_module_name_for_an_encoder_block_number_zero",
                    nn.Linear(3, 3))
    text = render(map_check(path, _case(port)))
    assert max(len(line) for line in text.splitlines()) <= 100


def test_bad_input_is_refused_with_a_sentence(reference, tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        map_check(tmp_path / "missing.h5", _case(Port()))
    seed_everything(0)
    summary = capture(Case(model=Reference(), inputs=(torch.randn(2, WIDTH),),
                           loss_fn=lambda o: o.sum()), tmp_path / "summary.h5", summary=True)
    with pytest.raises(TraceError, match="summary trace") as info:
        map_check(summary, _case(Port()))
    assert str(summary) in str(info.value)
    with pytest.raises(CaseError, match=r"needs a layerdiff\.Case"):
        map_check(reference, numpy_port())
    with pytest.raises(MappingError, match="does not exist"):
        map_check(reference, _case(Port()), tmp_path / "missing.toml")
