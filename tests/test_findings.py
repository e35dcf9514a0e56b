"""report/findings: every result type has its text through one ``render``, and the producers
below report/ never import it (results are data; issue 30)."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

from layerdiff.compare.result import Origin
from layerdiff.report import findings
from layerdiff.report.findings import render

PACKAGE = Path(findings.__file__).resolve().parents[2]  # layerdiff/
# above report/: the command line, the package's entry, the pytest plugin, show's tables, and
# the interactive session (moving to cli/)
ABOVE_REPORT = {"__init__.py", "__main__.py", "pytest_plugin.py", "show.py", "replay/session.py"}


def _origin(**fields) -> Origin:
    base = dict(step=0, pass_="forward", site="fc2#0", port_site="fc2#0", role="output",
                arg="0", port_arg="0", reason="its output is out", metrics={"ratio": 77.0})
    return Origin(**{**base, **fields})


@pytest.mark.parametrize("name", sorted(findings._RENDERERS))
def test_render_names_real_result_types_and_functions(name):
    module, _, cls = name.rpartition(".")
    assert isinstance(getattr(import_module(module), cls), type), name
    where, function = findings._RENDERERS[name]
    assert callable(getattr(import_module(where, findings.__name__), function)), name


def test_an_origin_reads_as_one_line_naming_the_port_only_when_it_differs():
    assert render(_origin()) == "fc2#0, forward output, step 0: 77x tolerance"
    renamed = _origin(port_site="dec.fc#0", arg="bias", ranks=[1])
    assert render(renamed) == ("fc2#0 (port dec.fc#0), forward output 'bias', step 0, "
                               "rank 1's part: 77x tolerance")


def test_a_type_without_text_is_refused():
    with pytest.raises(TypeError, match="no text for a dict"):
        render({})


def test_rendering_an_origin_or_a_diff_leaves_torch_unimported():
    code = ("import sys; from layerdiff.compare.result import Origin; "
            "from layerdiff.report.findings import render; import layerdiff.report.terminal; "
            "print(render(Origin(0, 'forward', 'a#0', 'a#0', 'output', '0', '0', 'r'))); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_nothing_below_report_imports_report():
    upward = []
    paths = sorted(PACKAGE.rglob("*.py"))
    assert len(paths) > 50, PACKAGE
    for path in paths:
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith(("report/", "cli")) or name in ABOVE_REPORT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = (node.module or "" if isinstance(node, ast.ImportFrom) else
                      " ".join(a.name for a in node.names) if isinstance(node, ast.Import)
                      else "")
            if "layerdiff.report" in module:
                upward.append(f"{name}:{node.lineno} imports {module}")
    assert not upward, upward
