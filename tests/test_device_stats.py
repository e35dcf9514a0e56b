"""Statistics and digests computed with torch reductions (the GPU path), run on CPU tensors:
min, max, NaN and Inf counts and the digest equal the host path's bit for bit; mean, std and
l2 equal it to float64 summation order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from layerdiff.capture.device_stats import DeviceStatistics
from layerdiff.trace.stats import Stats, compute_stats


def _host(tensor: torch.Tensor) -> Stats:
    data = tensor.detach().contiguous()
    if data.dtype == torch.bfloat16:
        return compute_stats(data.view(torch.uint16).numpy().reshape(-1), "bfloat16")
    return compute_stats(data.numpy().reshape(-1), str(data.dtype).removeprefix("torch."))


def _same(device: Stats, host: Stats) -> None:
    for name in ("min", "max"):
        a, b = getattr(device, name), getattr(host, name)
        assert a == b or (math.isnan(a) and math.isnan(b)), (name, a, b)
    assert (device.nan, device.inf, device.digest) == (host.nan, host.inf, host.digest)
    for name in ("mean", "std", "l2"):
        a, b = getattr(device, name), getattr(host, name)
        if math.isnan(b) or math.isinf(b):
            assert a == b or (math.isnan(a) and math.isnan(b)), (name, a, b)
        else:
            assert a == pytest.approx(b, rel=1e-9, abs=1e-300), (name, a, b)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 129, generator=g)
    with_nan = x.clone()
    with_nan[3, 5] = math.nan
    with_nan[7, 7] = math.inf
    with_nan[8, 8] = -math.inf
    return [
        x,                                   # several blocks, a short last one
        x.t(),                               # a strided view
        x[:1, :3],                           # smaller than a block
        with_nan,
        torch.full((5,), math.nan),          # nothing but NaN
        torch.tensor([math.inf, -math.inf]),  # nothing finite
        x.to(torch.bfloat16),
        x.to(torch.float16)[:, :7],
        x.double() * 1e200,                  # float64 squares past the range: scaled sums
        x.double() * 1e-200,                 # float64 squares below the range
        torch.randint(-5, 5, (1001,), generator=g),
        torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        torch.tensor([True, False, True]),
        torch.tensor([-0.0, 0.0]),
        torch.tensor([1000.0, 1000.001]),    # a spread far below the mean
        torch.tensor(3.5),                   # 0-d
    ]


def test_every_statistic_equals_the_host_path():
    device = DeviceStatistics()
    tensors = _tensors()
    handles = [device.add(t)[0] for t in tensors]
    device.flush()
    for tensor, handle in zip(tensors, handles, strict=True):
        _same(handle.get(), _host(tensor))


def test_a_full_arena_and_a_tensor_larger_than_it():
    device = DeviceStatistics(arena_bytes=16 * 4096)
    tensors = [torch.randn(3000, generator=torch.Generator().manual_seed(i)) for i in range(9)]
    tensors.append(torch.randn(100_000))  # larger than the arena: reduced alone
    handles = [device.add(t)[0] for t in tensors]
    device.flush()
    for tensor, handle in zip(tensors, handles, strict=True):
        _same(handle.get(), _host(tensor))


def test_values_are_taken_when_recorded_not_when_reduced():
    device = DeviceStatistics()
    x = torch.arange(10.0)
    handle, _ = device.add(x)
    x.mul_(100)  # an in-place op after the record (ReLU(inplace=True) and the like)
    device.flush()
    _same(handle.get(), _host(torch.arange(10.0)))


def test_padding_of_an_earlier_batch_does_not_leak_into_the_next():
    device = DeviceStatistics(arena_bytes=4 * 4096)
    first, _ = device.add(torch.full((1000,), 7.0))
    device.flush()
    small = torch.tensor([1.0, 2.0])
    second, _ = device.add(small)
    device.flush()
    _same(first.get(), _host(torch.full((1000,), 7.0)))
    _same(second.get(), _host(small))
    assert np.isclose(second.get().max, 2.0)


@pytest.mark.parametrize("summary", [False, True])
def test_a_capture_through_the_device_path_records_what_the_host_path_does(
        tmp_path, monkeypatch, summary):
    """The whole GPU capture path (arena, batched reductions, statistics handed to the
    recorder's threads), forced onto CPU tensors: the same index and the same bytes."""
    import functools

    from layerdiff.capture import capture, torch_capture
    from layerdiff.capture.stage import Stager
    from layerdiff.trace.reader import open_trace

    spec = "reference_models.transformer:reference"
    host = capture(spec, tmp_path / "host.h5", summary=summary, steps=2)
    monkeypatch.setattr(torch_capture, "Stager", functools.partial(Stager, device_stats=True))
    device = capture(spec, tmp_path / "device.h5", summary=summary, steps=2)
    with open_trace(host) as a, open_trace(device) as b:
        rows_a, rows_b = a.index.sort_values("seq"), b.index.sort_values("seq")
        assert len(rows_a) == len(rows_b) > 100
        for column in ("site", "role", "arg", "dtype", "shape", "min", "max", "nan", "inf",
                       "digest"):
            assert rows_a[column].tolist() == rows_b[column].tolist(), column
        for column in ("mean", "std", "l2"):
            np.testing.assert_allclose(rows_b[column], rows_a[column], rtol=1e-9, atol=1e-300)
        if not summary:
            for (_, row_a), (_, row_b) in zip(rows_a.iterrows(), rows_b.iterrows(),
                                              strict=True):
                if row_a["kind"] == "tensor":  # read back verified against the index
                    assert np.array_equal(a.read(row_a, raw=True), b.read(row_b, raw=True))
