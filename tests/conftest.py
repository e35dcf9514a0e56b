from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from layerdiff import capture, load_case
from layerdiff.cli import main

pytest_plugins = ["pytester"]

# Tests are small: one thread keeps them fast and their timing steady on 2 cores.
torch.set_num_threads(1)


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
