"""The metric kernel compiled ahead of time (compare/aot.py): a diff that finds it never
imports numba, gives the JIT's rows bit for bit, and falls back to the JIT for what the build
does not cover; a build is never taken for another source, version or CPU, nor given arrays
it was not built for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
    """An export does not check its arguments: only exact, aligned, contiguous arrays of a
    built combination are handed to it; anything else goes to the JIT."""
    built = aot.Compiled({F32: "f32 export"})
    values, bits, ratios = np.ones(64, np.float32), np.ones(64, np.int32), np.zeros(4)
    assert built.lookup(values, values, bits, bits, ratios) == "f32 export"
    unaligned = np.frombuffer(np.zeros(257, np.uint8).data, np.float32, 64, offset=1)
    assert not unaligned.flags.aligned
    assert built.lookup(unaligned, values, bits, bits, ratios) is None
    assert built.lookup(np.ones(128, np.float32)[::2], values, bits, bits, ratios) is None
    assert built.lookup(values.astype(">f4"), values, bits, bits, ratios) is None
    assert built.lookup(values.astype(np.float64), values, bits, bits, ratios) is None
    assert built.lookup(values, values, bits.astype(np.int16), bits, ratios) is None
    assert built.lookup(values, values, bits, bits, ratios.astype(np.float32)) is None
    assert built.lookup(values.reshape(8, 8), values, bits, bits, ratios) is None


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
