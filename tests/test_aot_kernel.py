"""The metric kernel compiled ahead of time (compare/aot.py): a diff that finds it never
imports numba, gives the JIT's rows bit for bit, and falls back to the JIT for what the build
does not cover; a build is never taken for another source, version or CPU, nor given arrays
it was not built for."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import pytest

from layerdiff import TraceWriter
from layerdiff.compare import aot

F32 = ("float32", "float32", "int32")


def _pair(tmp_path, dtype, name: str) -> tuple[str, str]:
    """A 2**20-element pair within tolerance (NaN and Inf where the reference has them, a
    subnormal, -0.0): no origin, so no hint reads it back (a hint's read checks statistics,
    which trace/verify.py computes with numba's other kernel at this size)."""
    rng = np.random.default_rng(5)
    values = rng.standard_normal(1 << 20).astype(dtype)
    values[[3, 77, 1000, 5]] = [np.nan, np.inf, -0.0, 1e-45 if dtype == np.float32 else 5e-324]
    port = values * dtype(1 + 1e-7)
    port[1000] = 0.0
    paths = []
    for side, data in (("ref", values), ("port", port)):
        path = tmp_path / f"{name}-{side}.h5"
        with TraceWriter(path) as writer:
            site = writer.enter("layer", "Linear")
            writer.record(site, "output", data.reshape(8, -1))
            writer.exit(site)
        paths.append(str(path))
    return paths[0], paths[1]


DIFFS = """
import json, sys, layerdiff
out = []
for ref, port in zip(sys.argv[1::2], sys.argv[2::2]):
    rows = layerdiff.diff(ref, port).rows
    row = rows.iloc[0].to_dict()
    row["batch_ratio"] = [float(x) for x in row["batch_ratio"]]
    out.append({"numba": "numba" in sys.modules,
                "row": {k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()
                        if isinstance(v, (int, float, str, list))}})
print(json.dumps(out))
"""


def _diffs(pairs, **env) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", DIFFS, *(p for pair in pairs for p in pair)],
                          check=True, capture_output=True, text=True,
                          env={**os.environ, **env})
    assert "layerdiff: not loading" not in done.stderr, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(aot.module_name() is None, reason="no /proc/cpuinfo or no numba")
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
def test_a_built_kernel_spares_a_diff_numba_and_gives_the_jits_rows(tmp_path):
    cache = tmp_path / "kernels"
    with warnings.catch_warnings():  # numba.pycc's pending deprecation
        warnings.simplefilter("ignore")
        pytest.importorskip("numba.pycc")
        aot.build(cache, combinations=(F32,))
    f32 = _pair(tmp_path, np.float32, "f32")
    f64 = _pair(tmp_path, np.float64, "f64")  # not built: the JIT serves it
    built = _diffs([f32, f64], LAYERDIFF_KERNEL_CACHE=str(cache))
    jitted = _diffs([f32, f64], LAYERDIFF_KERNEL_CACHE=str(cache), LAYERDIFF_AOT="0")
    assert [d["numba"] for d in built] == [False, True]
    assert [d["numba"] for d in jitted] == [True, True]
    for with_build, with_jit in zip(built, jitted, strict=True):
        assert with_build["row"] == with_jit["row"]  # every column, the sums too
    assert built[0]["row"]["verdict"] == "within" and built[0]["row"]["ref_nan"] == 1
    assert float(built[0]["row"]["max_abs"]) > 0
    # the digest's block sums are built into the same module: the bytes the diff read were
    # checked against their digests without numba, with the definition's own numbers
    from layerdiff.trace import digest
    module = aot.Compiled({}, _built_function(cache, aot.DIGEST_EXPORT))
    data = np.random.default_rng(9).integers(0, 256, 7 * digest.BLOCK_BYTES, dtype=np.uint8)
    streamed = digest.Digester(module.digest)
    streamed.update(data)
    assert streamed.hexdigest() == digest.digest_bytes(data)


def _built_function(cache, name: str):
    import importlib.machinery
    import importlib.util

    path = next(cache.glob("*" + importlib.machinery.EXTENSION_SUFFIXES[0]))
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_arrays_a_build_was_not_made_for_are_refused():
    """An export does not check its arguments: Compiled.fused hands it only exact, aligned,
    contiguous arrays of a built combination, of matching sizes, with batch rows inside
    ``batch_ratio`` and finite tolerances; anything else is None (the JIT serves it) and the
    export never runs."""
    calls = []
    built = aot.Compiled({F32: lambda *args: calls.append(args) or ("ran",)})
    values = np.ones(64, np.float32)
    args = aot.arguments(values, values, "int32", batch=4)
    assert args[4] == 32 and args[8] == 16 and args[9].size == 4
    assert built.fused(*args) == ("ran",) and len(calls) == 1

    def refused(**changes):
        names = ("ref", "port", "ref_bits", "port_bits", "ulp_width", "rtol", "atol", "start",
                 "per_element", "batch_ratio", "known_ratio", "known_finite", "known_rel")
        given = dict(zip(names, args, strict=True))
        given.update(changes)
        return built.fused(*given.values()) is None

    unaligned = np.frombuffer(np.zeros(257, np.uint8).data, np.float32, 64, offset=1)
    assert not unaligned.flags.aligned
    assert refused(ref=unaligned)
    assert refused(ref=np.ones(128, np.float32)[::2])
    assert refused(ref=values.astype(">f4"))
    assert refused(ref=values.astype(np.float64))
    assert refused(ref_bits=args[2].astype(np.int16))
    assert refused(batch_ratio=args[9].astype(np.float32))
    assert refused(ref=values.reshape(8, 8))
    assert refused(port=values[:63])                       # would read past the port
    assert refused(ref_bits=args[2][:63])                  # ULPs of elements not there
    assert refused(ulp_width=16)                           # int32 bits are 32 wide
    assert refused(ulp_width=1.5)
    assert refused(batch_ratio=np.zeros(3))                # a row past the end: a write
    assert refused(start=16)                               # rows 1..4 of 4
    assert refused(start=-1)
    assert refused(per_element=-16)
    assert refused(rtol=float("nan")) and refused(atol=-1.0)
    assert refused(ref="not an array")
    assert not refused(start=16, batch_ratio=np.zeros(5))  # rows 1..4 of 5
    assert not refused(ulp_width=0, ref_bits=np.zeros(0, np.int32),
                       port_bits=np.zeros(0, np.int32))
    assert len(calls) == 3


def test_the_built_digest_is_given_whole_blocks_only():
    """The digest's export is called on whole 4 KiB blocks of aligned words; anything else
    is numpy's definition, with the same numbers."""
    from layerdiff.trace import digest

    calls = []

    def sums(words, lane_a, lane_b, out):
        calls.append(words.size)
        assert words.dtype == np.int32 and words.flags.aligned
        assert out.shape == (words.size // digest.BLOCK, 2)
        out[:] = digest.block_sums(words.view(np.uint8))

    built = aot.Compiled({}, sums).digest
    data = np.random.default_rng(3).integers(0, 256, 3 * digest.BLOCK_BYTES + 1, np.uint8)
    want = digest.fold(digest.block_sums(data[1:]), 2, (5, 7))
    assert built.fold_lanes(data[1:], digest.weights(), 2, 5, 7) == want  # unaligned: copied
    assert calls == [3 * digest.BLOCK]
    short = data[:digest.BLOCK_BYTES + 8]
    assert built.fold_lanes(short, digest.weights(), 0, 0, 0) == digest.fold(
        digest.block_sums(short), 0, (0, 0))
    assert calls == [3 * digest.BLOCK]  # a part block never reaches the export


def test_a_build_is_named_by_the_kernels_source(tmp_path, monkeypatch):
    """An edited kernel (or another numba, numpy, Python or CPU) never loads an old build."""
    name = aot.module_name()
    if name is None:
        pytest.skip("no /proc/cpuinfo or no numba")
    edited = tmp_path / "kernels.py"
    edited.write_bytes(aot._KERNEL_SOURCE.read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(aot, "_KERNEL_SOURCE", edited)
    assert aot.module_name() != name
    monkeypatch.setattr(aot, "_cpu", lambda: "another cpu")
    assert aot.module_name() not in (name, None)


# ------------------------------------------------------------------ what the cache trusts

CC = shutil.which("cc") or shutil.which("gcc")
MARKER = "LAYERDIFF_TEST_MARKER"
PLANTED_C = r"""
#include <Python.h>
#include <stdio.h>
#include <stdlib.h>
static struct PyModuleDef planted = {PyModuleDef_HEAD_INIT, "%(name)s", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_%(name)s(void) {
    const char *marker = getenv("%(marker)s");
    if (marker) { FILE *f = fopen(marker, "w"); if (f) { fputs("ran", f); fclose(f); } }
    return PyModule_Create(&planted);
}
"""


@pytest.fixture(scope="module")
def planted_module(tmp_path_factory):
    """An extension module under the built kernel's name that writes $LAYERDIFF_TEST_MARKER
    when it is loaded: whether it ran is a file, not a guess."""
    import sysconfig

    name = aot.module_name()
    if name is None:
        pytest.skip("no /proc/cpuinfo or no numba")
    if CC is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("planted")
    source = folder / "planted.c"
    source.write_text(PLANTED_C % {"name": name, "marker": MARKER})
    built = folder / aot.module_file(name)
    subprocess.run([CC, "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"],
                    str(source), "-o", str(built)], check=True, capture_output=True)
    return built.read_bytes()


class Planted:
    """A cache folder (0700, ours, in a 0700 folder of ours) holding the planted module and
    its true sha256 record: exactly what a build leaves."""

    def __init__(self, root, data: bytes, monkeypatch):
        self.root = root
        self.folder = root / "kernels"
        self.folder.mkdir(mode=0o700)
        self.file = self.folder / aot.module_file(aot.module_name())
        self.record = self.folder / (self.file.name + aot.RECORD_SUFFIX)
        self.file.write_bytes(data)
        os.chmod(self.file, 0o644)
        self.write_record(data)
        self.marker = root / "marker"
        monkeypatch.setenv(MARKER, str(self.marker))
        monkeypatch.setenv("LAYERDIFF_KERNEL_CACHE", str(self.folder))
        monkeypatch.delenv("LAYERDIFF_AOT", raising=False)
        monkeypatch.setenv("LAYERDIFF_AOT_BUILD", "0")

    def write_record(self, data: bytes) -> None:
        import hashlib
        self.record.write_text(f"{hashlib.sha256(data).hexdigest()}  {self.file.name}\n")
        os.chmod(self.record, 0o644)

    def load(self, capsys):
        """(whether the planted module ran, the lines load() said on stderr)."""
        aot.load.cache_clear()
        try:
            aot.load()
        finally:
            aot.load.cache_clear()
        lines = capsys.readouterr().err.splitlines()
        return self.marker.exists(), lines


@pytest.fixture
def planted(tmp_path, planted_module, monkeypatch):
    os.chmod(tmp_path, 0o700)
    return Planted(tmp_path, planted_module, monkeypatch)


def _other_user(path, monkeypatch) -> None:
    """``path`` made another user's: chown to nobody where we are root (CI, here), else this
    process told it is someone else."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534, follow_symlinks=False)
    else:
        uid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: uid + 1)


def test_a_module_layerdiff_built_is_loaded(planted, capsys):
    """The control: the marker works, and a trusted folder with a true record loads, also
    through a sticky folder that others can write (/tmp) and a link in a folder of ours."""
    assert planted.load(capsys) == (True, [])
    planted.marker.unlink()
    sticky = planted.root / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    os.rename(planted.folder, sticky / "kernels")
    os.symlink(sticky / "kernels", planted.root / "link")
    os.environ["LAYERDIFF_KERNEL_CACHE"] = str(planted.root / "link")
    assert planted.load(capsys) == (True, [])


CASES = {
    "the folder is writable by others": lambda p, m: os.chmod(p.folder, 0o777),
    "the folder is writable by its group": lambda p, m: os.chmod(p.folder, 0o770),
    "the folder belongs to another user": lambda p, m: _other_user(p.folder, m),
    "a folder above is writable by others": lambda p, m: os.chmod(p.root, 0o757),
    "the module belongs to another user": lambda p, m: _other_user(p.file, m),
    "the module is writable by others": lambda p, m: os.chmod(p.file, 0o646),
    "the record belongs to another user": lambda p, m: _other_user(p.record, m),
    "the record is writable by its group": lambda p, m: os.chmod(p.record, 0o664),
    "the record is missing": lambda p, m: p.record.unlink(),
    "the record is another module's": lambda p, m: p.write_record(b"another build"),
    "the module is a link": lambda p, m: (os.rename(p.file, p.root / "real.so"),
                                          os.symlink(p.root / "real.so", p.file)),
    "the record is a link": lambda p, m: (os.rename(p.record, p.root / "real.sha256"),
                                          os.symlink(p.root / "real.sha256", p.record)),
    "the module is not a file": lambda p, m: (p.file.unlink(), os.mkfifo(p.file)),
    "a link on the way sits in a folder others can write": lambda p, m: (
        (p.root / "open").mkdir(), os.chmod(p.root / "open", 0o777),
        os.symlink(p.folder, p.root / "open" / "link"),
        m.setenv("LAYERDIFF_KERNEL_CACHE", str(p.root / "open" / "link"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_planted_module_is_never_loaded(planted, capsys, monkeypatch, case):
    """Anything but a module of ours, in folders only we can change, with its true sha256
    beside it, is not loaded (the module would have written the marker) and is named in
    one line on stderr: the JIT serves."""
    CASES[case](planted, monkeypatch)
    ran, lines = planted.load(capsys)
    assert not ran, lines
    assert len(lines) == 1 and lines[0].startswith("layerdiff: not loading the built kernel ")
    assert lines[0].endswith("; using the JIT")


def test_a_relative_cache_path_is_never_used(planted, capsys, monkeypatch):
    """A relative LAYERDIFF_KERNEL_CACHE or XDG_CACHE_HOME would be inside whatever folder
    the diff runs in (a received folder of traces): the first is refused with one line, the
    second ignored as the XDG spec says (~/.cache instead, here empty: no line)."""
    monkeypatch.chdir(planted.root)
    monkeypatch.setenv("LAYERDIFF_KERNEL_CACHE", "kernels")
    ran, lines = planted.load(capsys)
    assert not ran and len(lines) == 1
    assert "LAYERDIFF_KERNEL_CACHE='kernels' is a relative path" in lines[0]

    xdg = planted.root / "xdg" / "layerdiff"
    xdg.mkdir(parents=True)
    os.rename(planted.folder, xdg / "kernels")
    monkeypatch.delenv("LAYERDIFF_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "xdg")
    home = planted.root / "home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    assert aot.cache_dir() == home / ".cache" / "layerdiff" / "kernels"
    assert planted.load(capsys) == (False, [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(planted.root / "xdg"))  # the control
    assert planted.load(capsys) == (True, [])


def test_aot_0_loads_nothing(planted, capsys, monkeypatch):
    monkeypatch.setenv("LAYERDIFF_AOT", "0")
    assert planted.load(capsys) == (False, [])


# ------------------------------------------------------------------ the background build

@pytest.fixture
def builds(tmp_path, monkeypatch):
    """start_build with the build's start recorded instead of spawned: each started build
    holds its lock (a dup of the descriptor, as the child's inherited one) until released."""
    monkeypatch.delenv("LAYERDIFF_AOT", raising=False)
    monkeypatch.delenv("LAYERDIFF_AOT_BUILD", raising=False)
    monkeypatch.setattr(aot, "_c_compiler", lambda: "/usr/bin/cc")
    os.chmod(tmp_path, 0o700)
    started = []

    def spawn(folder, name, lock_fd):
        started.append((folder, name, os.dup(lock_fd)))
    monkeypatch.setattr(aot, "_spawn", spawn)
    yield started
    for *_, fd in started:
        with contextlib.suppress(OSError):
            os.close(fd)


def test_a_missing_build_starts_one_in_the_background_once(tmp_path, builds, capsys,
                                                           monkeypatch):
    """A diff that finds no build starts one, never two at once (an flock the build holds
    for its life), again once it ended without a module, not for a day after one failed; it
    makes the folders 0700; it never waits."""
    folder = tmp_path / "cache" / "layerdiff" / "kernels"
    assert aot.start_build(folder, "mod")
    assert [(f, n) for f, n, _ in builds] == [(str(folder), "mod")]
    assert {oct(os.stat(p).st_mode & 0o777) for p in (folder, folder.parent)} == {"0o700"}
    lock = folder / (aot.module_file("mod") + ".lock")
    assert oct(os.stat(lock).st_mode & 0o777) == "0o600"
    assert not aot.start_build(folder, "mod")          # running: not a second
    assert aot.start_build(folder, "other")            # another module's own lock
    os.close(builds[0][2])                             # the build ended (crashed, even)
    assert aot.start_build(folder, "mod") and len(builds) == 3
    os.pwrite(builds[2][2], b"failed\n", 0)
    os.close(builds[2][2])
    assert not aot.start_build(folder, "mod")          # failed an hour ago: not again
    os.utime(lock, (time.time() - 2 * 86400,) * 2)
    assert aot.start_build(folder, "mod") and len(builds) == 4
    assert capsys.readouterr().err == ""


def test_load_starts_the_build_only_where_allowed(tmp_path, builds, capsys, monkeypatch):
    if aot.module_name() is None:
        pytest.skip("no /proc/cpuinfo or no numba")
    monkeypatch.setenv("LAYERDIFF_KERNEL_CACHE", str(tmp_path / "kernels"))
    for setting in ({"LAYERDIFF_AOT": "0"}, {"LAYERDIFF_AOT_BUILD": "0"}):
        with monkeypatch.context() as patch:
            for key, value in setting.items():
                patch.setenv(key, value)
            aot.load.cache_clear()
            assert aot.load() is None and builds == []
    aot.load.cache_clear()
    assert aot.load() is None
    aot.load.cache_clear()
    assert [n for _, n, _ in builds] == [aot.module_name()]
    assert capsys.readouterr().err == ""  # absence is no doubt: nothing said
    monkeypatch.setattr(aot, "_c_compiler", lambda: None)
    assert not aot.start_build(tmp_path / "kernels", "another")


def test_no_build_into_a_folder_others_can_write(tmp_path, builds, capsys):
    os.chmod(tmp_path, 0o700)
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    assert not aot.start_build(tmp_path / "open", "mod")
    assert not aot.start_build(tmp_path / "open" / "kernels", "mod")  # made, but under it
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all("writable by" in line for line in lines)
    assert builds == []
    if aot.module_name() is not None:  # else build() refuses before it looks at the folder
        with pytest.raises(RuntimeError, match="writable by"):
            aot.build(tmp_path / "open")


def test_the_background_build_is_detached_and_quiet(tmp_path, monkeypatch):
    """What _spawn starts: this interpreter on this layerdiff, in the cache folder (never the
    working folder on sys.path), its own session, no terminal in or out, the lock passed."""
    seen = {}

    class Popen:
        def __init__(self, command, **options):
            seen.update(options, command=command)
    monkeypatch.setattr(aot.subprocess, "Popen", Popen)
    monkeypatch.setenv("PYTHONPATH", "")
    aot._spawn(str(tmp_path), "mod", 7)
    assert seen["command"][0] == sys.executable and "-P" in seen["command"]
    assert seen["command"][-4:] == ["--background", str(tmp_path), "mod", "7"]
    assert seen["cwd"] == str(tmp_path) and seen["pass_fds"] == (7,)
    assert seen["start_new_session"]
    assert {seen[k] for k in ("stdin", "stdout", "stderr")} == {subprocess.DEVNULL}
    assert seen["env"]["LAYERDIFF_AOT_BUILD"] == "0"
    assert "" not in seen["env"]["PYTHONPATH"].split(os.pathsep)  # no empty entry: the cwd


def test_a_failed_background_build_says_so_in_its_lock(tmp_path, monkeypatch):
    lock = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        def fails(folder):
            raise RuntimeError("no compiler after all")
        monkeypatch.setattr(aot, "build", fails)
        monkeypatch.setattr(aot, "module_name", lambda: "mod")
        assert aot._background(str(tmp_path), "mod", lock) == 1
        assert os.pread(lock, 64, 0) == b"failed\n"
        assert aot._background(str(tmp_path), "older", lock) == 0
        assert os.pread(lock, 64, 0) == b"stale\n"
    finally:
        os.close(lock)


def test_a_cache_folder_it_cannot_write_loads_from_a_private_temporary_copy(
        planted, capsys, monkeypatch):
    """The verified bytes are loaded from a private copy: in the cache folder, else (read
    only) in a temporary folder only we can change; no copy is left behind."""
    made = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if dir is not None:
            raise PermissionError("read-only")
        return made(*args, dir=str(planted.root), **kwargs)
    monkeypatch.setattr(aot.tempfile, "mkdtemp", mkdtemp)
    assert planted.load(capsys) == (True, [])
    assert sorted(p.name for p in planted.root.iterdir()) == ["kernels", "marker"]
    assert sorted(p.name for p in planted.folder.iterdir()) == [planted.file.name,
                                                                 planted.record.name]


def test_a_diff_in_a_received_folder_never_runs_a_module_planted_there(planted, tmp_path):
    """The audit's case end to end: `layerdiff diff` run inside a folder of traces that holds
    a planted module under the right name, with its true record, named by a relative
    LAYERDIFF_KERNEL_CACHE or XDG_CACHE_HOME. The module never runs, the diff's rows come
    from the JIT (exit 0: the pair is within tolerance), and the first case says why in one
    line."""
    _pair(planted.root, np.float32, "received")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    xdg = planted.root / "xdg" / "layerdiff" / "kernels"
    xdg.parent.mkdir(parents=True)
    shutil.copytree(planted.folder, xdg)
    base = {k: v for k, v in os.environ.items()
            if k not in ("LAYERDIFF_KERNEL_CACHE", "XDG_CACHE_HOME")}
    for env, said in (({"LAYERDIFF_KERNEL_CACHE": "kernels"}, 1), ({"XDG_CACHE_HOME": "xdg"}, 0)):
        done = subprocess.run([sys.executable, "-m", "layerdiff", "diff", "received-ref.h5",
                               "received-port.h5"], cwd=planted.root, capture_output=True,
                              text=True, env={**base, "HOME": str(home), **env}, check=False)
        assert done.returncode == 0, done.stderr
        assert not planted.marker.exists()
        lines = [line for line in done.stderr.splitlines() if "kernel" in line]
        assert len(lines) == said, done.stderr
