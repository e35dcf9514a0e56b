"""Statistics of one recorded step's tensors, taken when the tensor is seen, reduced in batches.

The monitor must cost a few percent of a training step, so a tensor's statistics are never
taken with per-tensor torch reductions (four passes at ~2 GB/s on a CPU, each a dispatch) nor
read back to the host one tensor at a time. On the CPU, a large tensor (at least
``DIRECT_BYTES``) is reduced where it lies, zero-copy, by the trace's compiled one-pass kernel
(min, max, float64 sums, NaN and Inf counts at ~10 GB/s; no digest, a second pass); a small one
is copied into a reused arena (a memcpy) and the arena reduced in one compiled call when it
fills or the step ends: per-tensor Python, not bytes, is what small tensors cost. On a GPU the
capture's device arenas (capture/device_stats.py) reduce a batch with a few kernels and the
numbers cross to the host once, when the file is written.

Copying a small tensor at once, and reducing a large one at once, sees its values as they are
when the hook runs: an in-place op later in the step does not change what was recorded.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from layerdiff.capture.device_stats import DeviceStatistics
from layerdiff.trace import schema
from layerdiff.trace import stats as trace_stats
from layerdiff.trace.stats import Stats

# At or above this many bytes a CPU float tensor is reduced in place (a call costs ~5 us of
# Python, a copy of this many bytes ~5 us): below, copied into the arena and batched.
DIRECT_BYTES = 1 << 16
ARENA_BYTES = 8 * 2**20
_FLOATS = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}
_SUPPORTED = frozenset(_FLOATS) | frozenset({torch.uint8, torch.int8, torch.int16, torch.int32,
                                             torch.int64, torch.bool})


_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in _SUPPORTED}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    return name if name is not None else str(dtype).removeprefix("torch.")


def supported(tensor: torch.Tensor) -> bool:
    """Whether the monitor takes this tensor's statistics (dense floats, integers, bools;
    quantized dtypes are none of these)."""
    return (tensor.dtype in _SUPPORTED and tensor.layout is torch.strided
            and tensor.numel() > 0)


class StepStatistics:
    """Slots of statistics for one recorded step: ``add`` a tensor, get its slot; ``finish``
    once the step is over; ``results`` then holds a Stats (or a device's pending Stats,
    answered when read) per slot."""

    def __init__(self, arena_bytes: int = ARENA_BYTES, *, reduce_on_device: bool = False
                 ) -> None:
        # reduce_on_device: CPU tensors too through the device arenas (how a GPU's path is
        # tested without one: device_stats.py runs the same reductions on CPU tensors)
        self._all_on_device = reduce_on_device
        self._arena = torch.empty(arena_bytes, dtype=torch.uint8)
        self._raw = self._arena.numpy()
        self._used = 0
        self._spans: list[tuple[int, int, str]] = []
        self._span_slots: list[int] = []
        self._device: DeviceStatistics | None = None
        self._kernel = trace_stats.compiled()
        self.results: list[Any] = []

    def reset(self) -> None:
        self.results = []

    def add(self, tensor: torch.Tensor) -> int:
        """A slot for ``tensor``'s statistics as they are now (see the module's docstring)."""
        slot = len(self.results)
        self.results.append(None)
        tensor = tensor.detach()
        if tensor.device.type != "cpu" or self._all_on_device:
            self.results[slot] = self._on_device(tensor)
            return slot
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes >= DIRECT_BYTES or nbytes > self._arena.numel() // 2:
            self.results[slot] = self._direct(tensor, nbytes)
            return slot
        size = -(-nbytes // schema.ALIGN) * schema.ALIGN
        if self._used + size > self._arena.numel():
            self._reduce_arena()
        start = self._used
        self._arena[start:start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self._used += size
        self._spans.append((start, nbytes, dtype_name(tensor.dtype)))
        self._span_slots.append(slot)
        return slot

    def add_many(self, tensors: list[torch.Tensor]) -> list[int]:
        """Slots for many tensors at once (a step's parameters, its gradients): on the CPU,
        the large ones reduced where they lie, the small ones copied with one ``torch.cat``
        per dtype and reduced in one compiled call, where a call per tensor would cost more
        Python than their bytes take."""
        slots = list(range(len(self.results), len(self.results) + len(tensors)))
        self.results.extend([None] * len(tensors))
        groups: dict[torch.dtype, list[int]] = {}
        for i, tensor in enumerate(tensors):
            nbytes = tensor.numel() * tensor.element_size()
            if tensor.device.type != "cpu" or self._all_on_device:
                self.results[slots[i]] = self._on_device(tensor.detach())
            elif nbytes >= DIRECT_BYTES:
                self.results[slots[i]] = self._direct(tensor.detach(), nbytes)
            else:
                groups.setdefault(tensor.dtype, []).append(i)
        for dtype, chosen in groups.items():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in chosen])
            raw = flat.view(torch.uint8).numpy()
            item = flat.element_size()
            spans, start = [], 0
            for i in chosen:
                nbytes = tensors[i].numel() * item
                spans.append((start, nbytes, dtype_name(dtype)))
                start += nbytes
            found = trace_stats.batch_stats(raw, spans, fused=self._kernel is not None)
            for i, stats, (begin, nbytes, name) in zip(chosen, found, spans, strict=True):
                if stats is None:
                    stats = trace_stats.compute_stats(
                        raw[begin:begin + nbytes].view(schema.numpy_dtype(name)), name)
                self.results[slots[i]] = stats
        return slots

    def _on_device(self, tensor: torch.Tensor) -> Any:
        if self._device is None:
            self._device = DeviceStatistics()
        return self._device.add(tensor)[0]

    def finish(self) -> None:
        """Reduce what waits: the arena now, a device's arenas queued (read when written)."""
        self._reduce_arena()
        if self._device is not None:
            self._device.flush()

    def _reduce_arena(self) -> None:
        if not self._spans:
            return
        found = trace_stats.batch_stats(self._raw[:self._used], self._spans,
                                        fused=self._kernel is not None)
        for slot, stats, (start, nbytes, name) in zip(self._span_slots, found, self._spans,
                                                      strict=True):
            if stats is None:  # what the numpy path leaves: non-finite, or not float32/64
                raw = self._raw[start:start + nbytes].view(schema.numpy_dtype(name))
                stats = trace_stats.compute_stats(raw, name)
            self.results[slot] = stats
        self._spans, self._span_slots, self._used = [], [], 0

    def _direct(self, tensor: torch.Tensor, nbytes: int) -> Stats:
        name = dtype_name(tensor.dtype)
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        item = _FLOATS.get(tensor.dtype)
        if self._kernel is None or item is None:
            return trace_stats.compute_stats(raw.view(schema.numpy_dtype(name)), name)
        return _float_stats(self._kernel, raw, name, item)


def _float_stats(kernel: Any, raw: np.ndarray, name: str, item: int) -> Stats:
    """The trace's statistics of float bytes in one compiled pass, without the digest (a second
    pass over the bytes that a monitored step need not pay: statistics are what a diff of two
    monitored runs compares). Equal to ``trace.stats.span_stats`` but for the digest."""
    table = trace_stats.half_table(name) if item == 2 else None
    lo, hi, total, squares, nan, inf, k = kernel.chunk_stats(raw, item, table)
    count = raw.size // item - nan - inf
    if not count:
        if nan == raw.size // item:
            lo = hi = math.nan
        return Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, "")
    mean, std, l2, cancelled = trace_stats.moments(count, total, squares, k, lo, hi)
    if cancelled:
        values = trace_stats.as_float(raw.view(schema.numpy_dtype(name)), name)
        if nan or inf:
            values = values[np.isfinite(values)]
        std = trace_stats.two_pass_std(values, k)
    l2 = math.nan if nan else (math.inf if inf else l2)
    return Stats(lo, hi, mean, std, l2, nan, inf, "")


def resolve(value: Any) -> Stats:
    """A slot's Stats, waiting for a device's numbers where they are still on their way."""
    return value if isinstance(value, Stats) else value.get()
