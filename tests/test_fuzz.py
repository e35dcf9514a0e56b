"""A reader that refuses, never crashes or hangs (issue 17 part 2).

Mutants of a real trace (the families of scripts/fuzz_trace.py: byte flips, truncation, zeroed
blocks, attribute, meta and column edits, deleted or replaced members, other files reached
through external storage, links or virtual datasets) are each run in a forked child with a
timeout: every one must be refused with layerdiff's own one-sentence error, or give exactly the
unmutated answer while holding exactly the original content. Then the cases users worry about,
each named: external storage, external links, virtual datasets, a deeply nested meta, a zero
loss scale, a shape claiming 10^12 elements.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from layerdiff import TraceError, capture, diff, load_case, open_trace
from layerdiff.trace import schema

ROOT = Path(__file__).resolve().parent.parent
MLP = "reference_models.mlp:reference"


def _fuzzer():
    spec = importlib.util.spec_from_file_location("fuzz_trace", ROOT / "scripts" /
                                                  "fuzz_trace.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_trace"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    """The fuzzer module and one seed trace with its unmutated answer and content."""
    module = _fuzzer()
    folder = tmp_path_factory.mktemp("fuzz")
    path = capture(load_case(MLP), folder / "ref.h5", steps=2)
    copy = folder / "copy.h5"
    shutil.copyfile(path, copy)
    answer = module.normalized(diff(path, copy), {str(path): "REF", str(copy): "PORT"})
    return module, module.Seed("mlp-2step", path, answer, module.content(path)), folder


@seed(17)
@settings(max_examples=45, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(family=st.sampled_from(
    ["byte_flip", "truncate", "zero_block", "attr_edit", "meta_edit", "column_edit",
     "column_replace", "delete", "external"]), rng=st.integers(0, 2**32 - 1))
def test_every_mutant_is_refused_in_one_sentence_or_read_exactly(fuzz, family, rng):
    module, trace, folder = fuzz
    number = rng % 10**6
    result = module.run_isolated(trace, family, number, rng, folder, timeout=60)
    assert result["outcome"] in ("refused", "passed-correctly", "mutation-failed"), result


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    return capture(load_case(MLP), tmp_path_factory.mktemp("named") / "original.h5")


@pytest.fixture
def ref(original, tmp_path):
    """A fresh copy of the original trace, to damage."""
    path = tmp_path / "ref.h5"
    shutil.copyfile(original, path)
    return path


def _without_table_digests(h5: h5py.File) -> None:
    """Traces from other writers (or from before the digests of the tables and the meta) have
    none: the checks of the rows and settings themselves must still refuse what is damaged."""
    for table in (schema.INDEX_GROUP, schema.SITES_GROUP):
        h5.attrs.pop(schema.ATTR_TABLE_DIGEST.format(table=table), None)
    h5.attrs.pop(schema.ATTR_META_DIGEST, None)


def _refused(path: Path, match: str) -> str:
    with pytest.raises(TraceError, match=match) as caught, open_trace(path) as trace:
        for position in range(len(trace.index)):
            trace.read(position)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    return message


def test_external_storage_is_refused_although_its_bytes_are_right(original, ref, tmp_path):
    name = schema.segment_name(0)
    raw = tmp_path / "elsewhere.bin"
    with h5py.File(ref, "r+") as h5:
        data = h5[name][()]
        data.tofile(raw)  # the very same bytes: only where they live differs
        del h5[name]
        h5.create_dataset(name, shape=data.shape, dtype=data.dtype,
                          external=[(str(raw), 0, h5py.h5f.UNLIMITED)])
    _refused(ref, "external storage")
    with pytest.raises(TraceError, match="external storage"):
        diff(original, ref)


@pytest.mark.parametrize("member", ["index", "tensors", "index/seq", "tensors/000000"])
def test_an_external_link_is_refused(ref, tmp_path, member):
    other = tmp_path / "other.h5"
    shutil.copyfile(ref, other)
    with h5py.File(ref, "r+") as h5:
        del h5[member]
        h5[member] = h5py.ExternalLink(str(other), "/" + member)
    _refused(ref, "ExternalLink")


def test_a_virtual_dataset_is_refused(ref, tmp_path):
    other = tmp_path / "other.h5"
    shutil.copyfile(ref, other)
    name = schema.segment_name(0)
    with h5py.File(ref, "r+") as h5:
        shape = h5[name].shape
        del h5[name]
        layout = h5py.VirtualLayout(shape=shape, dtype=np.uint8)
        layout[...] = h5py.VirtualSource(str(other), name, shape=shape)
        h5.create_virtual_dataset(name, layout)
    _refused(ref, "virtual dataset")


def _set_meta(path: Path, **changes) -> None:
    with h5py.File(path, "r+") as h5:
        meta = json.loads(h5.attrs["meta"])
        meta.update(changes)
        h5.attrs["meta"] = json.dumps(meta)
        _without_table_digests(h5)


def test_a_deeply_nested_meta_is_refused_before_parsing(ref):
    with h5py.File(ref, "r+") as h5:
        h5.attrs["meta"] = "[" * 100_000 + "]" * 100_000  # json.loads would recurse
        _without_table_digests(h5)
    _refused(ref, "nests deeper")


@pytest.mark.parametrize("scale", [0, -1.0, "1", True, 10**400])
def test_an_impossible_loss_scale_is_refused(ref, scale):
    _set_meta(ref, loss_scale=scale)
    _refused(ref, "loss scale")


def test_a_shape_of_a_trillion_elements_is_refused_before_any_allocation(ref):
    with h5py.File(ref, "r+") as h5:
        _without_table_digests(h5)  # the reader's own checks, as for another writer
        h5["index/shape"][0] = "1000000,1000000"
        h5["index/numel"][0] = 10**12
        h5["index/nbytes"][0] = 4 * 10**12
    # refused when the index is first read: its segment cannot hold 4 TB, so nothing of
    # that size is ever allocated
    _refused(ref, "the index puts data up to byte 4000000")


def test_a_shape_beyond_any_tensor_is_refused(ref):
    with h5py.File(ref, "r+") as h5:
        _without_table_digests(h5)  # the reader's own checks, as for another writer
        h5["index/shape"][0] = ",".join(["1000000"] * 4)
    _refused(ref, "more than any tensor")


def test_a_table_text_that_is_not_utf8_is_refused(ref):
    with h5py.File(ref, "r+") as h5:
        _without_table_digests(h5)  # the reader's own checks, as for another writer
        h5["index/site"][0] = b"fc1\xc3#0"
    _refused(ref, "index/site cannot be read")


def test_a_zeroed_global_heap_is_refused_instead_of_hanging(ref):
    """libhdf5 1.14 spins forever on a free-space object of size 0 in a global heap."""
    data = bytearray(ref.read_bytes())
    at = data.find(b"GCOL")
    assert at >= 0
    size = int.from_bytes(data[at + 8:at + 16], "little")
    data[at + 16:at + size] = bytes(size - 16)
    ref.write_bytes(bytes(data))
    _refused(ref, "global heap")
