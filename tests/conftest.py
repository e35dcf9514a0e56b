from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from layerdiff import capture, load_case
from layerdiff.cli import main

pytest_plugins = ["pytester"]

# Tests are small: one thread keeps them fast and their timing steady on 2 cores.
torch.set_num_threads(1)

# A diff that finds no kernel compiled ahead of time starts building one in the background
# (compare/aot.py). Not from the suite (its processes inherit this): a compiler started by
# whichever test first reads a large pair would take a core from the rest for ~15 s of a 2-core
# run, and whether a later test's diff then loads the build or the JIT would depend on the
# timing. tests/test_aot_kernel.py exercises the build's decision with the spawn injected.
os.environ.setdefault("LAYERDIFF_AOT_BUILD", "0")


@pytest.fixture
def trace_path(tmp_path):
    return tmp_path / "trace.h5"


@pytest.fixture
def run(monkeypatch):
    """Invoke the command line in-process, from the repository root; returns click's Result."""
    monkeypatch.chdir(Path(__file__).parent.parent)

    def invoke(*args, input=None):
        return CliRunner().invoke(main, [str(a) for a in args], input=input)
    return invoke


@pytest.fixture(scope="session")
def reference_traces(tmp_path_factory):
    """``get(spec, **capture_options)``: a trace of a bundled case, captured once per session."""
    cache: dict[tuple, Path] = {}

    def get(spec: str, **options):
        key = (spec, tuple(sorted(options.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp("ref") / "ref.h5"
            cache[key] = capture(load_case(spec), path, **options)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def rank_captures(tmp_path_factory):
    """The 2-rank captures of tests/rank_captures.py (and their one-process reference), by
    name: one group of 2 spawned processes for the session."""
    from tests.rank_captures import capture_all

    return capture_all(tmp_path_factory.mktemp("ranks"))


@pytest.fixture
def screenshot(tmp_path):
    """``screenshot(page, height)``: a headless Chromium's picture of an HTML file, as RGB floats
    in [0, 1] (1200 pixels wide); skips when Chromium is not installed (.ci/run installs it)."""
    import shutil
    import subprocess
    import time

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed: .ci/run installs it with apt-get; install it "
                    "with `apt-get install chromium` to run this test")

    def take(page: Path, height: int):
        from matplotlib.image import imread

        shot = tmp_path / "shot.png"
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start. The other
        # flags keep a headless run from reaching for the network or a GPU, or from filling a
        # container's small /dev/shm.
        command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                   "--no-first-run", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                   f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                   f"--window-size=1200,{height}", Path(page).resolve().as_uri()]
        started = time.monotonic()
        result = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                check=False)
        assert shot.exists(), (f"chromium wrote no screenshot (exit {result.returncode}, "
                               f"{time.monotonic() - started:.1f} s):\n{result.stderr[-2000:]}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        return imread(shot)[..., :3]  # drop alpha

    return take


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is faster than two fighting over a shared machine (a module
    asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
