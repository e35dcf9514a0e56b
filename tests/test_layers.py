"""The layering of docs' map holds in the code: no module imports a higher part (report/ is
above every producer, cli/ above all), and no modules import each other in a loop. Measured
from the code's own imports, those inside functions included (scripts/import_graph.py)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def _graph_module():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_module_imports_a_higher_part():
    graph = _graph_module()
    edges = graph.graph()
    unknown = sorted({graph.part(m) for m in edges} - set(graph.FLOOR))
    assert not unknown, f"parts missing from the layering in {SCRIPT.name}: {unknown}"
    assert graph.upward(edges) == []


def test_no_modules_import_each_other_in_a_loop():
    graph = _graph_module()
    assert graph.cycles(graph.graph()) == []


def test_the_checks_see_a_planted_upward_arrow_and_loop():
    graph = _graph_module()
    edges = {"layerdiff.trace.reader": {"layerdiff.report.text"}, "layerdiff.report.text": set(),
             "layerdiff.compare.a": {"layerdiff.compare.b"},
             "layerdiff.compare.b": {"layerdiff.compare.a"}}
    assert graph.upward(edges) == [("layerdiff.trace.reader", "layerdiff.report.text")]
    assert graph.cycles(edges) == [["layerdiff.compare.a", "layerdiff.compare.b"]]


def test_a_traces_bytes_are_read_past_h5py_only_in_trace():
    """preadv and mmap on a trace's file live in layerdiff/trace/ (direct.py): one reader with
    the fast paths, which the diff and the browser use."""
    package = SCRIPT.parents[1] / "layerdiff"
    outside = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if path.parent.name != "trace" and path.parent != package / "trace"
                     and any(word in path.read_text(encoding="utf-8")
                             for word in ("os.preadv(", "mmap.mmap(")))
    assert outside == []
