"""A trace, manifest or command line crafted to hurt must end in one sentence and exit 2 (or
run correctly): never a hang, a signal, a traceback, or escape sequences on the terminal.

Each hang test runs the command in a subprocess under a generous timeout (20 s): before the
fixes these ran for minutes, after them for well under a second on any machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layerdiff import TraceWriter
from layerdiff.mapping import Mapping, Pattern

ROOT = Path(__file__).resolve().parent.parent
HANG = 20  # seconds: what "finishes" means here; the fixed commands take well under one


def _layerdiff(*args, timeout: float = HANG) -> subprocess.CompletedProcess:
    """The command line in its own process, so that a hang is a timeout and a crash a signal."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "layerdiff", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _trace(path: Path, modules: list[str], meta: dict | None = None) -> Path:
    with TraceWriter(path, meta=meta) as writer:
        for module in modules:
            with writer.site(module) as site:
                writer.record(site, "output", np.arange(4, dtype=np.float32))
    return path


def _recorded(text: str, name: str = "port.map.toml") -> dict:
    """A port trace's meta saying its weights were loaded through the mapping ``text``."""
    return {"weights": {"from": "ref.h5", "mapping": {"name": name, "text": text}}}


# ---- A: patterns from a trace's recorded mapping ------------------------------------------

LONG = "a" * 60


def test_a_glob_of_many_stars_recorded_in_a_trace_does_not_hang_the_diff(tmp_path):
    # each '*' used to become its own '(.*)': C(76, 16) ways to fail on a 60-letter name
    rules = '[[site]]\nreference = "****************Z"\nport = "****************Z"\n'
    ref = _trace(tmp_path / "ref.h5", [LONG])
    port = _trace(tmp_path / "port.h5", [LONG], _recorded(rules))
    done = _layerdiff("diff", ref, port)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_a_glob_matches_what_greedy_stars_would():
    # the captures are those of a greedy (.*) per '*', adjacent stars included
    cases = [("a.*.b", "a.x.y.b", ("x.y",)), ("*.*", "a.b.c", ("a.b", "c")),
             ("**", "abc", ("abc", "")), ("a*", "a", ("",)), ("*a*", "aaa", ("aa", "")),
             ("x*y", "xy", ("",)), ("ab*ba", "aba", None), ("", "", ()), ("a", "b", None)]
    for glob, name, captures in cases:
        assert Pattern(glob).match(name) == captures, (glob, name)


def test_a_glob_agrees_with_the_regular_expression_it_replaces():
    import random
    import re

    rng = random.Random(0)
    for _ in range(20000):
        glob = "".join(rng.choice("ab.*") for _ in range(rng.randint(0, 7)))
        name = "".join(rng.choice("ab.") for _ in range(rng.randint(0, 9)))
        source = "".join("(.*)" if p == "*" else re.escape(p) for p in re.split(r"(\*)", glob))
        found = re.fullmatch(source, name)
        assert Pattern(glob).match(name) == (found.groups() if found else None), (glob, name)


def test_a_regex_recorded_in_a_trace_is_refused_and_the_map_option_runs_it(tmp_path):
    # (a|aa)+ backtracks exponentially on a name it does not match
    rules = "[[site]]\nreference_regex = '^(a|aa)+$'\nport = 'b'\n"
    ref = _trace(tmp_path / "ref.h5", [LONG + "b"])
    port = _trace(tmp_path / "port.h5", [LONG + "b"], _recorded(rules))
    done = _layerdiff("diff", ref, port)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    message = " ".join(done.stderr.split())
    assert "port.map.toml line 1: site rule 1 is a reference_regex" in message
    assert "read from port.h5" in message
    assert "--map port.map.toml" in message
    # the user who trusts the file passes it: its regular expression runs
    safe = tmp_path / "port.map.toml"
    safe.write_text("[[site]]\nreference_regex = '^(a+)b$'\nport = '\\1b'\n")
    assert _layerdiff("diff", ref, port, "--map", safe).returncode == 0


def test_a_recorded_mapping_without_regex_is_still_applied():
    mapping = Mapping.from_text('[[site]]\nreference = "enc.*"\nport = "e.*"\n', "m.toml",
                                recorded_in="port.h5")
    assert mapping.rename("enc.3")[0] == "e.3"
