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
    rules = ('[[site]]\nreference = "****************Z"\nport = "****************Z"\n'
             '[[unmatched]]\nport = "*a*a*a*a*a*a*a*a*a*a*a*a*a*a*a*aZ"\n'
             '[[param]]\nport = "*.*.*.*.*.*.*.*.*.*.*.*.*.*.*.*Z"\nreference = "w"\n')
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


def test_a_recorded_mapping_with_a_bad_key_is_refused_naming_the_trace(tmp_path):
    # the file the capture was given may be gone or fixed since: the sentence says the mapping
    # is the one the trace recorded, and that --map FILE overrides it
    rules = '[[shard]]\nsite = "m"\ntensor = "output"\ndimm = 0\n'
    ref = _trace(tmp_path / "ref.h5", ["m"])
    port = _trace(tmp_path / "port.h5", ["m"], _recorded(rules))
    done = _layerdiff("diff", ref, port)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    message = " ".join(done.stderr.split())
    assert "port.h5 recorded a mapping at capture that cannot be read" in message
    assert "port.map.toml line 1: unknown key 'dimm' in shard rule 1" in message
    assert "--map FILE overrides the recorded one" in message
    good = tmp_path / "fixed.toml"
    good.write_text("version = 1\n")
    assert _layerdiff("diff", ref, port, "--map", good).returncode == 0


def test_a_recorded_mapping_without_regex_is_still_applied():
    mapping = Mapping.from_text('[[site]]\nreference = "enc.*"\nport = "e.*"\n', "m.toml",
                                recorded_in="port.h5")
    assert mapping.rename("enc.3")[0] == "e.3"


# ---- B: root attributes of the wrong type -------------------------------------------------

ROOT_ATTRIBUTES = ["layerdiff_format", "layerdiff_version", "complete", "summary", "meta",
                   "meta_digest", "index_digest", "sites_digest"]


def _wrong_values():
    import h5py

    return {"int": np.int64(3), "float array": np.array([1.0, 2.0]),
            "opaque": np.void(b"layerdiff"), "fixed string": np.bytes_(b"layerdiff-trace"),
            "vlen bytes": (b"\xff\xfe", h5py.string_dtype("ascii")),
            "compound": np.array((1, 2.0), dtype=[("a", "<i4"), ("b", "<f8")])}


@pytest.mark.parametrize("attribute", ROOT_ATTRIBUTES)
def test_a_root_attribute_of_another_type_is_refused_as_damage(tmp_path, attribute):
    import h5py

    from layerdiff import open_trace
    from layerdiff.errors import TraceError

    good = _trace(tmp_path / "good.h5", ["m"])
    for kind, value in _wrong_values().items():
        if (attribute, kind) == ("layerdiff_version", "int"):
            continue  # its own type: a value, judged as one
        path = tmp_path / f"{kind.replace(' ', '_')}.h5"
        path.write_bytes(good.read_bytes())
        with h5py.File(path, "r+") as h5:
            del h5.attrs[attribute]
            if isinstance(value, tuple):
                h5.attrs.create(attribute, value[0], dtype=value[1])
            else:
                h5.attrs[attribute] = value
        for verify in (True, False):
            if (attribute, kind, verify) == ("meta_digest", "vlen bytes", False):
                continue  # a string still, and an unverifying reader never looks at it
            with pytest.raises(TraceError) as info:
                open_trace(path, verify=verify).close()
            message = str(info.value)
            assert message.startswith(f"{path}") and "\n" not in message, (kind, message)
            said = ("is incomplete",) if attribute == "complete" else (
                "damaged", "not a layerdiff trace")  # a complete flag that is no promise
            assert any(words in message for words in said), (kind, message)


def _datatype_flips(data: bytes, name: bytes) -> list[bytes]:
    """Copies of a trace's bytes with one byte changed in the attribute message of ``name``:
    its datatype, which follows the name, and the dataspace after it."""
    at = data.find(name + b"\0")
    assert at > 0
    flips = []
    for offset in range(at + len(name), at + len(name) + 32):
        for value in (0x00, 0xFF, data[offset] ^ 0x01, data[offset] ^ 0x80):
            damaged = bytearray(data)
            damaged[offset] = value
            flips.append(bytes(damaged))
    return flips


CHECK_ALL = """
import sys
from pathlib import Path
from layerdiff import open_trace
from layerdiff.errors import TraceError
for path in sys.argv[1:]:
    try:
        open_trace(path, verify=False).close()
    except TraceError as exc:
        assert "\\n" not in str(exc), str(exc)
"""


@pytest.mark.parametrize("attribute", ["layerdiff_format", "meta_digest", "layerdiff_version",
                                       "complete"])
def test_one_damaged_byte_in_a_root_attribute_type_is_never_a_crash(tmp_path, attribute):
    # a string attribute's datatype turned into a variable-length sequence segfaulted h5py
    good = _trace(tmp_path / "good.h5", ["m"])
    paths = []
    for number, damaged in enumerate(_datatype_flips(good.read_bytes(), attribute.encode())):
        paths.append(tmp_path / f"flip{number}.h5")
        paths[-1].write_bytes(damaged)
    done = subprocess.run([sys.executable, "-c", CHECK_ALL, *map(str, paths)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_show_of_a_trace_whose_format_attribute_type_is_damaged_exits_2(tmp_path):
    good = _trace(tmp_path / "good.h5", ["m"])
    data = bytearray(good.read_bytes())
    at = data.find(b"layerdiff_format\0") + len(b"layerdiff_format")
    vlen = data.index(0x19, at)       # datatype version 1, class 9: variable-length
    data[vlen + 1] = 0xFF             # its kind: a string no more
    damaged = tmp_path / "damaged.h5"
    damaged.write_bytes(data)
    for command in (["show", damaged], ["diff", good, damaged]):
        done = _layerdiff(*command)
        assert done.returncode == 2, (command, done.returncode, done.stderr[-2000:])
        assert "Traceback" not in done.stderr
        assert "layerdiff_format" in done.stderr and "damaged" in done.stderr


# ---- C: manifests that name themselves or another manifest -------------------------------

def _manifest_naming(path: Path, target: Path) -> Path:
    """A manifest whose one rank file is ``target``, with digests that match it (a crafted
    file can hold any): the meta digest is left out, as a verifying reader then skips it."""
    import json

    import h5py

    with TraceWriter(path, summary=True):
        pass
    with h5py.File(target if target.exists() else path, "r") as h5:
        digests = {"index": h5.attrs["index_digest"], "sites": h5.attrs["sites_digest"],
                   "meta": None}
    with h5py.File(path, "r+") as h5:
        meta = json.loads(h5.attrs["meta"])
        meta["manifest"] = {"world_size": 1, "ranks": [{"rank": 0, "file": target.name,
                                                        "digests": digests}]}
        h5.attrs["meta"] = json.dumps(meta)
        del h5.attrs["meta_digest"]
    return path


def test_a_manifest_naming_itself_is_refused_in_one_sentence(tmp_path):
    manifest = _manifest_naming(tmp_path / "port.h5", tmp_path / "port.h5")
    done = _layerdiff("show", manifest)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "rank 0's file" in done.stderr and "is itself a manifest" in done.stderr


def test_a_manifest_naming_another_manifest_is_refused(tmp_path):
    from layerdiff import open_trace
    from layerdiff.errors import TraceError

    inner = _manifest_naming(tmp_path / "inner.h5", tmp_path / "inner.h5")
    outer = _manifest_naming(tmp_path / "outer.h5", inner)
    with pytest.raises(TraceError, match=r"inner\.h5 is itself a manifest"):
        open_trace(outer)


# ---- D: control characters in names ------------------------------------------------------

EVIL = "e\x1b[2J\x1b]0;x\x07\t\x9bm"  # clears, retitles the window, a tab, a C1 CSI


def _no_controls(text: str) -> None:
    assert not any((ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F for c in text), text


def test_a_crafted_site_name_reaches_the_terminal_as_visible_escapes(tmp_path, run):
    trace = _trace(tmp_path / "port.h5", [EVIL, "dec"], meta={"case": "case\x1b[2J"})
    for command in (["show", trace, "--by-site"], ["show", trace]):
        result = run(*command)
        assert result.exit_code == 0, result.output
        _no_controls(result.output)
        assert ("e\\x1b[2J\\x1b]0;x\\x07\\x09\\x9bm#0" if "--by-site" in command
                else "\\x9bm#0") in result.output  # the records table clips from the left
        assert "case\\x1b[2J" in result.output or "--by-site" in command


def test_a_site_name_with_a_newline_is_refused_in_one_escaped_line(tmp_path, run):
    trace = _trace(tmp_path / "port.h5", ["enc\x1b[2J\nFAIL  everything"])
    result = run("show", trace, "--by-site")
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1
    _no_controls(result.output)
    assert "enc\\x1b[2J\\nFAIL  everything" in result.output


def test_a_diff_report_of_crafted_names_escapes_them(tmp_path, run):
    ref = _trace(tmp_path / "ref.h5", [EVIL])
    with TraceWriter(tmp_path / "port.h5") as writer, writer.site(EVIL) as site:
        writer.record(site, "output", np.arange(4, dtype=np.float32) + 1)
    result = run("diff", ref, tmp_path / "port.h5", "--verbose")
    assert result.exit_code == 1, result.output
    _no_controls(result.output)
    assert "\\x1b[2J" in result.output


def test_an_error_quoting_a_crafted_name_escapes_it(tmp_path, run, monkeypatch):
    from layerdiff.errors import TraceError

    def fail(*args, **kwargs):
        raise TraceError(f"{EVIL}\n is damaged")

    trace = _trace(tmp_path / "port.h5", ["m"])
    monkeypatch.setattr("layerdiff.show.select_records", fail)
    result = run("show", trace)
    assert result.exit_code == 2
    assert result.output.count("\n") == 1
    _no_controls(result.output)
    assert "e\\x1b[2J\\x1b]0;x\\x07\\x09\\x9bm\\x0a is damaged" in result.output


# ---- E: bad command lines ------------------------------------------------------------------

def test_a_negative_batch_axis_is_refused_in_one_sentence(run):
    result = run("batch-independence", "reference_models.mlp:reference", "--batch-axis", "-9")
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.output.count("\n") == 1
    assert "--batch-axis -9 is negative" in result.output and "2 dimensions" in result.output


@pytest.mark.parametrize("margin", ["nan", "inf", "-inf", "0", "-1"])
def test_golden_refuses_a_margin_that_is_no_factor_before_writing(tmp_path, run, margin):
    golden = tmp_path / "golden.h5"
    result = run("golden", "reference_models.mlp:reference", "-o", golden, "--calibrate", "2",
                 "--margin", margin)
    assert result.exit_code == 2, result.output
    assert "--margin" in result.output
    assert list(tmp_path.iterdir()) == []  # neither the golden nor a tolerance file


def test_calibrate_refuses_a_margin_that_is_no_factor(tmp_path):
    from layerdiff.ci import calibrate
    from layerdiff.errors import CaptureError

    with pytest.raises(CaptureError, match="finite number above 0"):
        calibrate("reference_models.mlp:reference", tmp_path / "t.toml", margin=float("nan"))
    assert list(tmp_path.iterdir()) == []
