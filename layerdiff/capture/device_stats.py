"""Statistics and digests of tensors computed where the tensors live, in batches, with torch ops.

On a GPU the host cannot keep up with the data a model makes (the host-side statistics ran at
~1.3 GB/s against activations made at tens of GB/s), and reading a tensor's statistics per
tensor would synchronise the stream each time. So a tensor is copied into a device arena when
it is recorded (one copy kernel: it sees the values as they are at that point of the stream,
whatever in-place op follows), and when the arena fills or the recorder hands a batch on, one
set of reductions over the whole arena gives every tensor's statistics and digest at once. Only
a small table of numbers per tensor crosses to the host, copied without waiting; the
recorder's statistics thread waits for it (an event) when it needs the numbers.

Each tensor starts on a 4 KiB boundary of its dtype's arena and the gap after it stays zero, so
the arena is a whole number of 4 KiB blocks, each block belongs to one tensor, and:

* the digest (trace/digest.py) is per block sums of the arena's words, folded per tensor: the
  zero padding is the definition's own;
* min and max are per block reductions over the valid elements (a mask from each block's valid
  length), then per tensor; NaN counts, Inf counts and float64 sums of the finite values need no
  mask (padding zeros add nothing).

The same code runs on CPU tensors, which is how CI tests it: min, max, the counts and the digest
are equal to the host path's bit for bit; mean, std and l2 to float64 summation order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from layerdiff.trace import digest
from layerdiff.trace.stats import SCALE_DOWN, SCALE_UP, TINY_SQUARES, Stats, moments

BLOCK_BYTES = digest.BLOCK_BYTES
DEFAULT_ARENA_BYTES = 64 * 2**20
# dtypes whose statistics the reductions take (others take the host path)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)
SUPPORTED = frozenset(_FLOATS + _INTEGERS)
# columns of the per-tensor table: the sums of float64 tensors also scaled by 2**-600 and
# 2**600 (stats.py, "scaled sums"): the host picks the one the host path would have taken;
# the digest's two folds without the length
_LO, _HI, _NAN, _INF, _SUM, _SQ, _SUM_DOWN, _SQ_DOWN, _SUM_UP, _SQ_UP, _DA, _DB = range(12)


@dataclass(slots=True)
class _Pending:
    """Tensors copied into one arena, not yet reduced."""

    offsets: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    used: int = 0


class PendingStats:
    """A tensor's statistics, on their way from the device: ``get()`` waits for them."""

    __slots__ = ("_nbytes", "_numel", "_row", "_table")

    def __init__(self, table: _Table, row: int, nbytes: int, numel: int) -> None:
        self._table, self._row, self._nbytes, self._numel = table, row, nbytes, numel

    def get(self) -> Stats:
        return self._table.stats(self._row, self._nbytes, self._numel)


class _Table:
    """One reduction's results on the host: a row of float64 per tensor, ready after
    ``ready`` (an event on the device's stream; None on the CPU)."""

    def __init__(self, values: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        self._values = values
        self._ready = ready
        self._rows: np.ndarray | None = None

    def stats(self, row: int, nbytes: int, numel: int) -> Stats:
        if self._rows is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._rows = self._values.numpy()
        return _to_stats(self._rows[row], nbytes, numel)


class DeviceStatistics:
    """Arenas (one per device and dtype) and the batched reductions over them."""

    def __init__(self, arena_bytes: int = DEFAULT_ARENA_BYTES) -> None:
        self.arena_bytes = max(BLOCK_BYTES, arena_bytes - arena_bytes % BLOCK_BYTES)
        self._arenas: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._pending: dict[tuple[torch.device, torch.dtype], _Pending] = {}
        self._waiting: dict[tuple[torch.device, torch.dtype], list[PendingStats]] = {}
        self._weights: dict[torch.device, torch.Tensor] = {}
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        return (tensor.dtype in SUPPORTED and tensor.layout is torch.strided
                and not tensor.is_quantized and tensor.numel() > 0)

    def add(self, tensor: torch.Tensor) -> tuple[PendingStats, torch.Tensor]:
        """Copy ``tensor`` into its arena (queued on the current stream); its statistics come
        with the arena's next reduction (``flush``). Returns them and the copy (valid until
        that reduction), from which the bytes go to the host (``copy_to_host``)."""
        key = (tensor.device, tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        span = -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES
        if span > self.arena_bytes:  # larger than an arena: reduced alone, in its own
            return self._alone(tensor, nbytes, span)
        pending = self._pending.setdefault(key, _Pending())
        if pending.used + span > self.arena_bytes:
            self.flush()
            pending = self._pending.setdefault(key, _Pending())
        arena = self._arena(key)
        snapshot = arena[pending.used:pending.used + nbytes].view(tensor.dtype)
        snapshot = snapshot.view(tensor.shape)
        snapshot.copy_(tensor.detach())
        pending.offsets.append(pending.used)
        pending.nbytes.append(nbytes)
        pending.used += span
        handle = PendingStats(None, len(pending.offsets) - 1, nbytes, tensor.numel())
        self._waiting.setdefault(key, []).append(handle)
        return handle, snapshot

    def flush(self) -> None:
        """Reduce every arena holding tensors; their PendingStats become answerable."""
        for key, pending in list(self._pending.items()):
            if pending.offsets:
                arena = self._arenas[key]
                table = self._reduce(arena[:pending.used], key[1], pending)
                for handle in self._waiting.pop(key, []):
                    handle._table = table
                self._wait_for_copies(key[0])
                arena[:pending.used].zero_()  # the padding of the next batch (stream order)
        self._pending.clear()

    def copy_to_host(self, target: torch.Tensor, snapshot: torch.Tensor) -> None:
        """Copy a snapshot into (pinned) host memory: on a GPU, on a side stream, so that the
        model's stream runs on while the copy engine works; ``fence`` then says when the
        copies queued so far have landed."""
        if snapshot.device.type != "cuda":
            target.copy_(snapshot)
            return
        side = self._side_stream(snapshot.device)
        side.wait_stream(torch.cuda.current_stream(snapshot.device))
        with torch.cuda.stream(side):
            target.copy_(snapshot, non_blocking=True)
        snapshot.record_stream(side)  # a lone tensor's buffer outlives the copy

    def fence(self) -> Callable[[], None]:
        """Mark the host copies queued so far; returns a function that waits for them."""
        events = []
        for device, side in self._side.items():  # and the model's stream: copies not made
            for stream in (side, torch.cuda.current_stream(device)):  # here run on it
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)

        def wait() -> None:
            for event in events:
                event.synchronize()
        return wait

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        return side

    def _wait_for_copies(self, device: torch.device) -> None:
        """The arena is reused after this, in stream order: wait for copies out of it."""
        side = self._side.get(device)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)

    def _alone(self, tensor: torch.Tensor, nbytes: int, span: int
               ) -> tuple[PendingStats, torch.Tensor]:
        buffer = torch.zeros(span, dtype=torch.uint8, device=tensor.device)
        snapshot = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        snapshot.copy_(tensor.detach())
        table = self._reduce(buffer, tensor.dtype, _Pending([0], [nbytes], span))
        return PendingStats(table, 0, nbytes, tensor.numel()), snapshot

    def _arena(self, key: tuple[torch.device, torch.dtype]) -> torch.Tensor:
        arena = self._arenas.get(key)
        if arena is None:
            arena = self._arenas[key] = torch.zeros(self.arena_bytes, dtype=torch.uint8,
                                                    device=key[0])
        return arena

    def _reduce(self, data: torch.Tensor, dtype: torch.dtype, pending: _Pending) -> _Table:
        device = data.device
        blocks = data.numel() // BLOCK_BYTES
        layout = torch.from_numpy(_layout(pending, blocks, dtype))
        if device.type == "cuda":  # one upload that does not wait for the stream
            layout = layout.pin_memory().to(device, non_blocking=True)
        valid, block_number = layout[:blocks], layout[blocks:2 * blocks]
        lengths = layout[2 * blocks:]
        per_block = BLOCK_BYTES // torch.empty(0, dtype=dtype).element_size()
        sums, lows, highs = _block_statistics(data.view(dtype).view(blocks, per_block), dtype,
                                              valid)
        terms = self._digest_terms(data.view(torch.int32).view(blocks, digest.BLOCK),
                                   block_number)
        # per tensor: its blocks are consecutive (segment_reduce is deterministic, where
        # index_add_ on a GPU adds in any order and refuses torch's deterministic mode)
        totals = torch.segment_reduce(torch.cat([sums, terms], 1), "sum", lengths=lengths)
        out = torch.cat([torch.segment_reduce(lows, "min", lengths=lengths)[:, None],
                         torch.segment_reduce(highs, "max", lengths=lengths)[:, None],
                         totals], 1)
        if device.type == "cuda":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            return _Table(host, ready)
        return _Table(out, None)

    def _digest_terms(self, words: torch.Tensor, block_number: torch.Tensor) -> torch.Tensor:
        """Per block, its two terms of the digest's folds (below 2**32: exact in float64,
        and so are their sums over any tensor below 2**21 blocks, 8 GiB)."""
        table = self._weights.get(words.device)
        if table is None:
            table = self._weights[words.device] = torch.from_numpy(
                np.array(digest.weights())).to(words.device)
        wide = words.long()
        q_b = block_number % digest.PRIME_B
        columns = []
        for lane, prime, weight in ((0, digest.PRIME_A, block_number),
                                    (1, digest.PRIME_B, q_b * q_b % digest.PRIME_B)):
            sums = (wide * table[:, lane]).sum(1)  # exact: |sum| < 2**61
            columns.append((torch.remainder(sums, prime) * weight % prime).double())
        return torch.stack(columns, 1)


def _block_statistics(values: torch.Tensor, dtype: torch.dtype, valid: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: (NaN count, Inf count, sum and sum of squares of the finite values, and the
    same scaled by 2**-600 and 2**600), min and max of the valid values that are not NaN."""
    inside = torch.arange(values.shape[1], device=values.device) < valid[:, None]
    if dtype in (torch.float16, torch.bfloat16):
        values = values.float()  # exact
    if dtype in _FLOATS:
        nan = torch.isnan(values)
        inf = torch.isinf(values)
        keep = inside & ~nan
        counts = [nan.sum(1, dtype=torch.float64), inf.sum(1, dtype=torch.float64)]
        finite = torch.where(nan | inf, 0, values).double()
        source = values
    else:
        keep = inside
        finite = values.double()
        counts = [torch.zeros(values.shape[0], dtype=torch.float64, device=values.device)] * 2
        source = finite
    lows = torch.where(keep, source, math.inf).amin(1).double()  # a scalar: no upload
    highs = torch.where(keep, source, -math.inf).amax(1).double()
    columns = [*counts, finite.sum(1), (finite * finite).sum(1)]
    if dtype == torch.float64:  # squares may leave float64's range: scaled sums too
        for factor in (SCALE_DOWN, SCALE_UP):
            scaled = finite * factor
            columns += [scaled.sum(1), (scaled * scaled).sum(1)]
    else:
        columns += [counts[0] * 0] * 4
    return torch.stack(columns, 1), lows, highs


def _layout(pending: _Pending, blocks: int, dtype: torch.dtype) -> np.ndarray:
    """Per block, how many of its elements are its tensor's, then per block its number within
    its tensor (from 1), then per tensor its number of blocks: one int64 array, one upload."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_block = BLOCK_BYTES // itemsize
    layout = np.zeros(2 * blocks + len(pending.offsets), dtype=np.int64)
    valid, number, lengths = layout[:blocks], layout[blocks:2 * blocks], layout[2 * blocks:]
    for tensor, (offset, nbytes) in enumerate(zip(pending.offsets, pending.nbytes,
                                                  strict=True)):
        first = offset // BLOCK_BYTES
        count = lengths[tensor] = -(-nbytes // BLOCK_BYTES)
        valid[first:first + count] = per_block
        valid[first + count - 1] = nbytes // itemsize - (count - 1) * per_block
        number[first:first + count] = np.arange(1, count + 1)
    return layout


def _to_stats(row: np.ndarray, nbytes: int, numel: int) -> Stats:
    """A row of the table as the Stats the host path computes (same rules: stats.py)."""
    dig = digest.finish((int(row[_DA]) % digest.PRIME_A, int(row[_DB]) % digest.PRIME_B),
                        nbytes)
    nan, inf = int(row[_NAN]), int(row[_INF])
    lo, hi = float(row[_LO]), float(row[_HI])
    count = numel - nan - inf
    if nan == numel:
        lo = hi = math.nan
    if not count:
        return Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, dig)
    total, squares, k = float(row[_SUM]), float(row[_SQ]), 0
    if not math.isfinite(squares):
        total, squares, k = float(row[_SUM_DOWN]), float(row[_SQ_DOWN]), 1
    elif squares < TINY_SQUARES and not (lo == 0 and hi == 0):
        total, squares, k = float(row[_SUM_UP]), float(row[_SQ_UP]), -1
    mean, std, l2, _ = moments(count, total, squares, k, lo, hi)
    l2 = math.nan if nan else (math.inf if inf else l2)
    return Stats(lo, hi, mean, std, l2, nan, inf, dig)

