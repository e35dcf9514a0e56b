"""The trace is the contract (docs/trace-format.md): which records a capture makes, in which
order, under which site, role and argument names, and the site table. A change to how the
capture walks the model's modules or hooks them must not change a byte of that.

The expectation files in ``data/trace_contract`` hold :func:`contract_lines` of
:func:`capture_case`, written by the capture code as it was before the module walk was shared
(issue 30). They hold names and shapes only, no values, so they hold on any machine. Cases: ops
of every module with a custom autograd function (op sites, their numbering, backward records), a
llama2.c-style model whose blocks call
``child.forward(...)`` directly (sites of direct calls), and an ``nn.MultiheadAttention`` whose
``out_proj`` is never called (its weights adopted by the attention's site).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from layerdiff import capture, load_case
from layerdiff.trace import open_trace

DATA = Path(__file__).parent / "data" / "trace_contract"
CASES = {
    "op_bugs_ops": ("reference_models.op_bugs:reference", {"ops": ["*"]}),
    "llama_direct_calls": ("reference_models.llama_port:port",
                           {"ops": ["layers.0.attention"]}),
    "mha_uncalled_owner": ("reference_models.batch_mixing:reference", {}),
}
INDEX = ["seq", "step", "pass", "site", "role", "arg", "kind", "dtype", "shape", "numel"]


def capture_case(name: str, path: Path) -> Path:
    spec, options = CASES[name]
    return capture(load_case(spec), path, **options)


def contract_lines(path: Path) -> list[str]:
    """Every index row's names and shape, then every site row, one line each."""
    with open_trace(path) as trace:
        index = trace.index
        sites = trace.sites
    lines = ["index " + " ".join(INDEX)]
    lines += [" ".join(str(v) for v in row) for row in index[INDEX].itertuples(index=False)]
    lines.append("sites " + " ".join(sites.columns))
    lines += [" ".join(str(v) for v in row) for row in sites.itertuples(index=False)]
    return lines


@pytest.mark.parametrize("name", list(CASES))
def test_capture_records_what_it_recorded_before(name: str, tmp_path: Path) -> None:
    expected = (DATA / f"{name}.txt").read_text().splitlines()
    got = contract_lines(capture_case(name, tmp_path / "trace.h5"))
    first = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    assert got == expected, (
        f"{name}: the trace differs from the recorded one; first at line {first}: "
        f"{got[first] if first is not None else len(got)!r} (expected "
        f"{expected[first] if first is not None else len(expected)!r})")
