"""The capture's fast paths record exactly what the general ones do.

- A contiguous CPU tensor is staged with one memmove instead of torch's copy_; every other
  tensor (a strided view, a complex one, a subclass) still takes copy_.
- A large tensor's statistics are taken on the capturing thread from the tensor's own memory
  (span_stats) instead of from the ring on the statistics thread (batch_stats): the same
  kernel over the same bytes, so the index is bit for bit the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerdiff import load_case
from layerdiff.capture import capture, stage
from layerdiff.trace import stats
from layerdiff.trace.reader import open_trace
from layerdiff.trace.recorder import Recorder


def _recorded(tmp_path, tensors, summary=False):
    path = tmp_path / f"t{len(list(tmp_path.iterdir()))}.h5"
    recorder = Recorder(path, {"producer": "test"}, summary=summary)
    stager = stage.Stager(recorder)
    for i, tensor in enumerate(tensors):
        stager.tensor(0, "forward", f"m{i}#0", "output", "0", tensor)
    recorder.close(complete=True)
    return open_trace(path)


def test_every_layout_is_recorded_as_its_values(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [
        base,                                     # contiguous: memmove
        base.t(),                                 # strided view: copy_
        base[1:3],                                # contiguous view with a storage offset
        torch.nn.Parameter(base.clone()),         # a Parameter is a plain tensor
        base.to(torch.bfloat16),
        torch.tensor([1 + 2j, 3 - 4j]).conj(),    # lazy conjugate: copy_ resolves it
        torch.ones(3, dtype=torch.bool),
        torch.empty(0, 3),
    ]
    trace = _recorded(tmp_path, tensors)
    rows = trace.index.sort_values("seq").reset_index(drop=True)
    for i, tensor in enumerate(tensors):
        got = trace.read(rows.iloc[i], raw=True)
        want = tensor.detach().resolve_conj()
        if want.dtype == torch.bfloat16:
            want = want.view(torch.uint16)
        assert np.array_equal(np.asarray(got), want.numpy()), i


def test_span_stats_equal_batch_stats_bit_for_bit():
    rng = np.random.default_rng(3)
    for name in ("float32", "float64", "float16", "bfloat16", "int64", "bool"):
        for kind in range(6):
            n = int(rng.integers(1, 3000))
            if name == "bfloat16":
                raw = (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16
                       ).astype(np.uint16)
                special = {1: 0x7FC0, 2: 0x7F80, 3: 0x7FC0}
            elif name in ("int64", "bool"):
                raw = rng.integers(0, 2 if name == "bool" else 1000, n).astype(
                    np.uint8 if name == "bool" else np.int64)
                special = {}
            else:
                raw = (rng.standard_normal(n) * 1e3).astype(name)
                special = {1: np.nan, 2: np.inf, 3: np.nan}
            if kind in (1, 2) and kind in special:
                raw[int(rng.integers(0, n))] = special[kind]
            if kind == 3 and kind in special:
                raw[:] = special[3]
            if kind == 4 and name.startswith("float"):
                raw[:] = 1000 + np.arange(n) * 1e-3  # the two-pass spread
            data = raw.view(np.uint8)
            want = stats.batch_stats(data, [(0, data.size, name)])[0]
            assert repr(stats.span_stats(data, name)) == repr(want), (name, kind)


@pytest.mark.parametrize("summary", [True, False])
def test_statistics_on_the_capturing_thread_give_the_same_trace(tmp_path, monkeypatch,
                                                               summary):
    assert stats.compiled() is not None  # loaded: the inline path is open from the start
    inline = capture(load_case("reference_models.transformer:reference"), tmp_path / "a.h5",
                     steps=2, summary=summary)
    monkeypatch.setattr(stage, "INLINE_STATS_BYTES", 1 << 62)  # every tensor via the ring
    ring = capture(load_case("reference_models.transformer:reference"), tmp_path / "b.h5",
                   steps=2, summary=summary)
    monkeypatch.setattr(stage, "INLINE_STATS_BYTES", 1)  # every tensor inline
    every = capture(load_case("reference_models.transformer:reference"), tmp_path / "c.h5",
                    steps=2, summary=summary)
    columns = ["site", "role", "arg", "dtype", "shape", "min", "max", "mean", "std", "l2",
               "nan", "inf", "digest"]
    frames = [open_trace(p).index.sort_values("seq")[columns].reset_index(drop=True)
              for p in (inline, ring, every)]
    assert frames[0].equals(frames[1]) and frames[0].equals(frames[2])
    if not summary:
        a, b = open_trace(inline), open_trace(ring)
        for (_, x), (_, y) in zip(a.index.sort_values("seq").iterrows(),
                                  b.index.sort_values("seq").iterrows(), strict=True):
            if x["kind"] == "tensor":
                assert np.array_equal(a.read(x, raw=True), b.read(y, raw=True))


def test_a_tensor_recorded_again_unchanged_reuses_its_statistics(tmp_path, monkeypatch):
    """A layer's input is the output recorded just before (a container's grad_input its first
    child's): its statistics are taken once. A change in place (the version counter moves) or
    a new tensor at the same address is reduced again."""
    assert stats.compiled() is not None   # loaded: tensors from 1 MiB take the inline path
    reduced = []
    span_stats = stats.span_stats
    monkeypatch.setattr(stats, "span_stats",
                        lambda raw, name: reduced.append(raw.nbytes) or span_stats(raw, name))
    path = tmp_path / "t.h5"
    recorder = Recorder(path, {"producer": "test"}, summary=True)
    stager = stage.Stager(recorder)
    x = torch.randn(512, 512)   # 1 MiB
    stager.tensor(0, "forward", "a#0", "output", "0", x)
    stager.tensor(0, "forward", "b#0", "input", "0", x)          # the same values: reused
    x.mul_(2)
    stager.tensor(0, "forward", "b#0", "output", "0", x)         # changed in place
    stager.tensor(0, "backward", "b#0", "grad_input", "0", x)    # unchanged again: reused
    address = x.data_ptr()
    del x
    y = torch.zeros(512, 512)   # likely at the freed address, version 0 again
    stager.tensor(0, "forward", "c#0", "output", "0", y)
    recorder.close(complete=True)
    assert len(reduced) == 3, (len(reduced), address == y.data_ptr())
    index = open_trace(path).index.sort_values("seq")
    first, repeat, doubled, again, zeros = (row for _, row in index.iterrows())
    assert again["digest"] == doubled["digest"]
    assert (repeat["min"], repeat["max"], repeat["digest"]) == (
        first["min"], first["max"], first["digest"])
    assert doubled["max"] == 2 * first["max"] and doubled["digest"] != first["digest"]
    assert zeros["max"] == 0.0


@pytest.mark.parametrize("in_place, remembered", [(False, 4096), (True, 4096), (False, 1)])
def test_a_tensor_recorded_again_unchanged_is_written_once(tmp_path, monkeypatch, in_place,
                                                            remembered):
    """A layer's input is its predecessor's output: a full trace points both index rows at
    one copy of the bytes (about half of a transformer's bytes a step). Changed in place in
    between, or recorded longer ago than the writer remembers where bytes went, it is
    written again."""
    from layerdiff import Case
    from layerdiff.trace import recorder

    monkeypatch.setattr(recorder, "_PLACED", remembered)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)]
    if in_place:
        layers.insert(1, torch.nn.ReLU(inplace=True))
    model = torch.nn.Sequential(*layers)
    x = torch.randn(1024, 512)  # 2 MiB activations: above the inline-statistics size
    case = Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0,
                name="again", steps=1)
    stats.compiled()  # loaded (a capture loads it at its first batch; its tensors come later)
    path = capture(case, tmp_path / "t.h5")
    with open_trace(path) as trace:
        index = trace.index

        def row(site: str, role: str):
            return index[(index["site"] == site) & (index["role"] == role)
                         & (index["step"] == 0)].iloc[0]

        produced, consumed = row("0#0", "output"), row(f"{len(layers) - 1}#0", "input")
        shared = ((produced["segment"], produced["offset"])
                  == (consumed["segment"], consumed["offset"]))
        assert shared == (not in_place and remembered > 1)
        want = model[0](x).relu() if in_place else model[0](x)
        assert np.allclose(np.asarray(trace.read(consumed)), want.detach().numpy())
