"""The tensor digest: one definition, computed alike by numpy, the compiled kernel, a stream of
chunks and torch (tests/test_device_stats.py); traces of the older xxh3 digest still verify."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pandas as pd
import pytest
import xxhash

from layerdiff.errors import TraceError
from layerdiff.trace import digest, schema, stats, stats_kernel
from layerdiff.trace.digest import BLOCK_BYTES, DIGEST_NAME, LEGACY_DIGEST
from layerdiff.trace.h5file import TraceFile
from layerdiff.trace.reader import open_trace
from layerdiff.trace.verify import check_bytes
from layerdiff.trace.writer import TraceWriter

LENGTHS = [0, 1, 2, 3, 4, 5, 7, 4095, 4096, 4097, 3 * BLOCK_BYTES + 2, 100_003]


def _numpy(data: np.ndarray) -> str:
    return digest.finish(digest.fold(digest.block_sums(digest.padded(data)), 0, (0, 0)),
                         data.size)


def test_the_definition_is_pinned():
    """The digest is part of the trace format: these values are in docs/trace-format.md."""
    assert _numpy(np.arange(10, dtype=np.uint8)) == "52cb250176eecedf"
    assert _numpy(np.zeros(0, np.uint8)) == "0000000000000000"
    assert digest.weights()[:3].tolist() == [[904624, 448903], [615925, 938392],
                                            [607568, 570693]]


@pytest.mark.parametrize("n", LENGTHS)
def test_numpy_compiled_and_streamed_agree(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = _numpy(data)
    assert digest.finish(stats_kernel.digest_lanes(data, digest.weights()), n) == want
    for kernel in (None, stats_kernel):
        streamed = digest.Digester(kernel)
        for piece in np.array_split(data, 5):  # cuts inside words and blocks
            streamed.update(piece)
        assert streamed.hexdigest() == want
        assert digest.digest_bytes(data, kernel) == want
    assert stats.digest(data) == want


def test_spans_of_a_buffer_are_digested_as_their_own_bytes():
    buffer = np.random.default_rng(1).integers(0, 256, 60_000, dtype=np.uint8)
    spans = [(0, 0), (4, 1), (8, 2), (12, 3), (16, 4), (24, 4097), (4124, 8192),
             (12320, 40_003)]
    lanes = np.empty((len(spans), 2), dtype=np.int64)
    stats_kernel.digest_spans(buffer, np.array([s for s, _ in spans]),
                              np.array([n for _, n in spans]), digest.weights(), lanes)
    for (start, size), (a, b) in zip(spans, lanes.tolist(), strict=True):
        assert digest.finish((a, b), size) == _numpy(buffer[start:start + size])


def test_any_one_word_changed_changes_the_digest():
    rng = np.random.default_rng(2)
    words = rng.integers(-2**31, 2**31, 3 * 1024 + 5, dtype=np.int64).astype(np.int32)
    base = _numpy(words.view(np.uint8))
    for position in rng.integers(0, words.size, 40):
        for delta in (1, -1, 2**23, digest.PRIME_B):
            changed = words.copy()
            changed[position] = np.int32((int(changed[position]) + delta + 2**31) % 2**32
                                         - 2**31)
            assert _numpy(changed.view(np.uint8)) != base
    # the one change of a word that is a multiple of P_A: -2**31 to 2**31 - 5
    words[7] = -2**31
    changed = words.copy()
    changed[7] = 2**31 - 5
    assert _numpy(changed.view(np.uint8)) != _numpy(words.view(np.uint8))


def test_bytes_moved_between_blocks_change_the_digest():
    data = np.random.default_rng(3).integers(0, 256, 4 * BLOCK_BYTES, dtype=np.uint8)
    swapped = np.concatenate([data[BLOCK_BYTES:2 * BLOCK_BYTES], data[:BLOCK_BYTES],
                              data[2 * BLOCK_BYTES:]])
    assert _numpy(swapped) != _numpy(data)
    assert _numpy(np.zeros(4, np.uint8)) != _numpy(np.zeros(8, np.uint8))  # length counts


def test_new_traces_name_their_digest_and_verify(tmp_path):
    with TraceWriter(tmp_path / "t.h5") as writer:
        writer.record("m#0", "output", np.arange(5000, dtype=np.float32))
    with open_trace(tmp_path / "t.h5") as trace:
        assert trace.meta["tensor_digest"] == DIGEST_NAME
        row = trace.index.iloc[0]
        assert row["digest"] == stats.digest(np.arange(5000, dtype=np.float32))
        trace.read(row)  # verified


def _legacy_copy(source, target):
    """A trace as a layerdiff before the digest change wrote it: xxh3 digests, no meta key."""
    with open_trace(source) as trace:
        meta = {k: v for k, v in trace.meta.items() if k != "tensor_digest"}
        index = trace.index.copy()
        raws = [trace.read(row, raw=True) for _, row in index.iterrows()]
        sites = trace.sites
    file = TraceFile(target, meta, summary=False)
    for i, raw in enumerate(raws):
        data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        index.loc[i, "segment"] = file.write_segment(data)
        index.loc[i, "offset"] = 0
        index.loc[i, "digest"] = xxhash.xxh3_64_hexdigest(data)
    file.append_rows(schema.INDEX_GROUP, {c: index[c].tolist() for c in schema.INDEX_COLUMNS})
    file.append_rows(schema.SITES_GROUP, {c: sites[c].tolist() for c in schema.SITES_COLUMNS})
    path = file.close(complete=True)
    with h5py.File(path, "r+") as h5:
        h5.attrs[schema.ATTR_VERSION] = 1
    return path


def test_a_trace_with_xxh3_digests_still_verifies_and_damage_is_found(tmp_path):
    with TraceWriter(tmp_path / "t.h5") as writer:
        writer.record("m#0", "output", np.linspace(-1, 1, 3000, dtype=np.float32))
    legacy = _legacy_copy(tmp_path / "t.h5", tmp_path / "legacy.h5")
    with open_trace(legacy) as trace:
        assert trace.digest_algorithm == LEGACY_DIGEST
        row = trace.index.iloc[0]
        data = trace.read(row, raw=True)
        damaged = np.array(data).copy()
        damaged[5] += 1e-3
        with pytest.raises(TraceError, match="does not match its digest"):
            check_bytes(damaged, row, str(legacy), algorithm=trace.digest_algorithm)
        with pytest.raises(TraceError, match="does not match its digest"):
            check_bytes(data, row, str(legacy), algorithm=DIGEST_NAME)  # the wrong definition


def test_an_unknown_digest_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(TraceError, match=r"tensor digests are 'sha9'.*does not know"):
        schema.parse_meta(json.dumps({"tensor_digest": "sha9"}), tmp_path / "t.h5")


def test_determinism_reads_the_bytes_when_two_runs_digest_differently(tmp_path):
    from layerdiff.debug.determinism import _same_bytes
    with TraceWriter(tmp_path / "t.h5") as writer:
        writer.record("m#0", "output", np.arange(3000, dtype=np.float32))
    legacy = _legacy_copy(tmp_path / "t.h5", tmp_path / "legacy.h5")
    with open_trace(tmp_path / "t.h5") as new, open_trace(legacy) as old:
        same = _same_bytes(new, old, new.index, pd.DataFrame(old.index))
    assert same.tolist() == [True]



def test_a_golden_of_the_older_digest_is_refused_with_what_to_do(tmp_path):
    from layerdiff.ci.check import check, golden

    spec = "reference_models.mlp:reference"
    old = _legacy_copy(golden(spec, tmp_path / "golden.h5"), tmp_path / "old_golden.h5")
    with pytest.raises(TraceError, match=r"format v1, older than the v2.*record it again"):
        check(spec, old)
