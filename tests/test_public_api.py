"""The public API: every name in ``layerdiff.__all__`` resolves, shows in ``dir``, and the
functions carry their real signatures; importing ``layerdiff`` alone leaves torch out."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import layerdiff
from layerdiff.capture import capture as capture_function
from layerdiff.replay import replay as replay_function

KEYWORDS = {
    "diff": {"mapping", "tolerances", "baseline", "progress"},
    "replay": {"mapping", "sites", "tolerances", "output"},
    "swap": {"mapping", "steps", "into", "tolerances", "baseline"},
    "bisect": {"granularity", "on_probe"},
    "capture": {"include", "exclude", "steps", "summary", "weights", "dtype", "autocast"},
}


@pytest.mark.parametrize("name", layerdiff.__all__)
def test_every_public_name_resolves_and_is_listed(name):
    assert getattr(layerdiff, name) is not None
    assert name in dir(layerdiff)


def test_all_lists_every_lazy_name():
    lazy = {*layerdiff._LAZY, *layerdiff._CALLABLE_PACKAGES}
    assert lazy <= set(layerdiff.__all__)
    assert len(set(layerdiff.__all__)) == len(layerdiff.__all__)


@pytest.mark.parametrize("name", sorted(KEYWORDS))
def test_public_functions_have_their_real_signatures(name):
    parameters = inspect.signature(getattr(layerdiff, name)).parameters
    assert KEYWORDS[name] <= set(parameters), parameters


def test_capture_and_replay_are_callable_packages_whatever_was_imported_first():
    import layerdiff.replay.swap  # binds the subpackage to layerdiff.replay

    for package, function in ((layerdiff.capture, capture_function),
                              (layerdiff.replay, replay_function)):
        assert inspect.ismodule(package) and callable(package)
        assert inspect.signature(package) == inspect.signature(function)
    from layerdiff import replay
    assert replay is layerdiff.replay


def test_importing_layerdiff_leaves_torch_unimported():
    code = ("import sys, layerdiff; dir(layerdiff); layerdiff.diff; layerdiff.open_trace; "
            "layerdiff.Mapping; layerdiff.Verdict; layerdiff.Role; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)
