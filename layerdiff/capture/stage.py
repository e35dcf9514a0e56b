"""Copy torch tensors into the recorder's staging ring: the only per-tensor work on the hot path."""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np
import torch

from layerdiff.capture.device_stats import DeviceStatistics
from layerdiff.capture.sharded import Aliases, Layouts, is_dtensor, local_part
from layerdiff.trace import stats
from layerdiff.trace.recorder import Recorder
from layerdiff.trace.writer import value_json


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unsupported_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """What a trace holds of a tensor whose bytes it cannot store (a sparse or quantized
    one): its layout, shape and dtype, as a plain value. Replay records a port's such
    tensor the same way, so the two compare."""
    return {"unsupported_tensor": repr(tensor.layout), "shape": list(tensor.shape),
            "dtype": dtype_name(tensor.dtype)}


class Stager:
    """Turns tensors and plain values into recorder submissions for one capture.

    A tensor on a GPU is copied into the ring by the copy engine, queued on the current stream
    (so it sees the values as they are at this point of the stream, in-place ops after it
    notwithstanding) without waiting: the ring is pinned so the copy can run asynchronously, and
    the writer threads wait on a CUDA event before they read those bytes. ``async_device``
    False makes those copies synchronous, as a CPU tensor's are.
    """

    def __init__(self, recorder: Recorder, *, async_device: bool = True,
                 device_stats: bool | None = None) -> None:
        self.recorder = recorder
        self.async_device = async_device
        # Statistics computed by torch where the tensor lives (device_stats.py): for GPU
        # tensors by default (None), for every tensor with True (how CI tests that path on
        # CPU tensors), never with False (the host computes them from the copied bytes).
        self._device_stats_everywhere = device_stats is True
        self.device = None if device_stats is False else DeviceStatistics()
        if self.device is not None:
            recorder.before_send = self.device.flush
        self._fenced = False   # the recorder has its fence (set at the first GPU tensor)
        self._pinned = False
        self._ring = torch.from_numpy(recorder.ring.buffer)  # shares memory with the ring
        self._ring_address = recorder.ring.buffer.ctypes.data
        # Per-dtype and per-shape facts, computed once: the hot path pays per Python call.
        self._typed: dict[torch.dtype, tuple[torch.Tensor, str, int, bool]] = {}
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}
        # the statistics of the last few large tensors, by (id, version, address): a layer's
        # input is the output recorded just before it, a container's grad_input its first
        # child's (47% of reference_large's bytes a step)
        self._recent: dict[tuple[int, int, int],
                           tuple[weakref.ref, stats.Stats, int, bool]] = {}
        # the layouts of the records that were DTensors (recorded as their local parts)
        self.layouts = Layouts()
        # plain tensors that alias a DTensor's local part: made at the first DTensor
        self.aliases: Aliases | None = None

    def tensor(self, step: int, pass_: str, site: str, role: str, arg: str,
               tensor: torch.Tensor) -> None:
        rec = self.recorder
        kind = type(tensor)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter and is_dtensor(tensor):
            # a sharded tensor: this rank's part, and a note of how the parts make the whole
            index = self.layouts.add(site, role, arg, tensor)
            if self.aliases is None:
                self.aliases = Aliases(self.layouts)
                # from now on every record goes through _tensor_noting_aliases first; a
                # capture that never sees a DTensor keeps this method as its only path
                self.tensor = self._tensor_noting_aliases
            self.aliases.part(tensor, index)
            tensor = local_part(tensor)
            kind = type(tensor)
        if tensor.layout is not torch.strided or tensor.is_quantized:
            self.value(step, pass_, site, role, arg, unsupported_tensor(tensor))
            return
        typed = self._typed.get(tensor.dtype)
        if typed is None:
            typed = self._typed[tensor.dtype] = self._dtype_facts(tensor)
        ring, name, itemsize, plain_bytes = typed
        shape = tuple(tensor.shape)
        nbytes = tensor.numel() * itemsize
        if (plain_bytes and nbytes and tensor.is_cpu and kind in _PLAIN_TYPES
                and tensor.is_contiguous() and nbytes <= rec.max_staged
                and not self._device_stats_everywhere):
            # The common case, a contiguous CPU tensor: its bytes are the record's bytes. One
            # memmove costs ~1 us where a view of the ring and copy_ cost ~6 (torch dispatch),
            # which was a quarter of the capture cost of a model of thousands of small tensors.
            found = None
            if nbytes >= INLINE_STATS_BYTES and stats.compiled_loaded():
                # A large tensor's statistics are taken here, from memory the model has just
                # written (in cache): a summary trace then copies none of its bytes, and a full
                # one reads them once less. The statistics are the same: one kernel, one span.
                # the same tensor object, alive, at the same version: the same bytes (an
                # inference tensor has no version counter). A gradient the engine could still
                # add to in place is one nothing else holds, and then its weak reference is dead
                repeatable = not tensor.is_inference()
                keep = rec.keeps_data(site)
                seen = self._unchanged(tensor) if repeatable else None
                if seen is not None:
                    found, first, first_kept = seen
                    if keep and first_kept and rec.can_share(first):
                        # its bytes are in the file already: the row points there
                        rec.submit(step, pass_, site, role, arg, name, shape, nbytes=nbytes,
                                   stats=found, same_as=first)
                        return
                else:
                    found = stats.span_stats(_bytes_of(tensor, nbytes), name)
                    if found is not None and repeatable:
                        self._remember(tensor, found, rec.seq, keep)
                if found is not None and not keep:
                    rec.submit(step, pass_, site, role, arg, name, shape, nbytes=nbytes,
                               stats=found)
                    return
            offset = rec.reserve(nbytes)
            copy = _memmove_holding_gil if nbytes <= _HOLD_GIL_BYTES else _memmove
            copy(self._ring_address + offset, tensor.data_ptr(), nbytes)
            rec.submit(step, pass_, site, role, arg, name, shape, offset=offset, nbytes=nbytes,
                       stats=found)
            return
        tensor = tensor.detach()
        if (self.device is not None and (tensor.is_cuda or self._device_stats_everywhere)
                and self.device.supports(tensor)):
            self._on_device(step, pass_, site, role, arg, tensor, name, shape, nbytes)
            return
        if nbytes > rec.max_staged:
            # Larger than half the ring: written synchronously from (a contiguous CPU copy of) it.
            rec.submit(step, pass_, site, role, arg, name, shape, nbytes=nbytes,
                       array=_as_numpy(tensor))
            return
        offset = rec.reserve(nbytes)
        strides = self._strides.get(shape)
        if strides is None:
            strides = self._strides[shape] = _contiguous_strides(shape)
        target = ring.as_strided(shape, strides, offset // itemsize)
        if tensor.is_cuda and self.async_device:
            if not self._fenced:
                self._pin(tensor.device)
            target.copy_(tensor, non_blocking=True)
            rec.copies_in_flight = True
        else:
            target.copy_(tensor)
        rec.submit(step, pass_, site, role, arg, name, shape, offset=offset, nbytes=nbytes)

    def _tensor_noting_aliases(self, step: int, pass_: str, site: str, role: str, arg: str,
                               tensor: torch.Tensor) -> None:
        """:meth:`tensor`, once a DTensor was recorded: a plain tensor is looked up among the
        DTensors' local parts (sharded.Aliases) first."""
        kind = type(tensor)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            self.aliases.plain(site, role, arg, tensor)
        Stager.tensor(self, step, pass_, site, role, arg, tensor)

    def _on_device(self, step: int, pass_: str, site: str, role: str, arg: str,
                   tensor: torch.Tensor, name: str, shape: tuple[int, ...], nbytes: int) -> None:
        """Statistics and digest reduced on the device; the bytes, where the file keeps them,
        copied to the ring from the device's snapshot of the tensor without waiting."""
        rec = self.recorder
        pending, snapshot = self.device.add(tensor)
        if not rec.keeps_data(site):
            rec.submit(step, pass_, site, role, arg, name, shape, nbytes=nbytes, stats=pending)
            return
        if nbytes > rec.max_staged:
            rec.submit(step, pass_, site, role, arg, name, shape, nbytes=nbytes,
                       array=_as_numpy(snapshot), stats=pending)
            return
        offset = rec.reserve(nbytes)
        typed = self._typed.get(tensor.dtype)
        if typed is None:
            typed = self._typed[tensor.dtype] = self._dtype_facts(tensor)
        strides = self._strides.get(shape)
        if strides is None:
            strides = self._strides[shape] = _contiguous_strides(shape)
        target = typed[0].as_strided(shape, strides, offset // typed[2])
        if snapshot.is_cuda and self.async_device:
            if not self._fenced:
                self._pin(tensor.device)
                rec.fence = self.device.fence  # the copies run on the device's side stream
            self.device.copy_to_host(target, snapshot)
            rec.copies_in_flight = True
        else:
            target.copy_(snapshot)
        rec.submit(step, pass_, site, role, arg, name, shape, offset=offset, nbytes=nbytes,
                   stats=pending)

    def _unchanged(self, tensor: torch.Tensor) -> tuple[stats.Stats, int, bool] | None:
        """This very tensor object, recorded a few records ago and not changed in place since
        (its version counter is the same): its statistics, the record that holds its bytes
        and whether the file kept them; else None."""
        seen = self._recent.get((id(tensor), tensor._version, tensor.data_ptr()))
        return seen[1:] if seen is not None and seen[0]() is tensor else None

    def _remember(self, tensor: torch.Tensor, found: stats.Stats, seq: int, kept: bool) -> None:
        # a weak reference: the tensor's memory is not held (and its id is not reused while the
        # reference answers it)
        recent = self._recent
        recent[(id(tensor), tensor._version, tensor.data_ptr())] = (weakref.ref(tensor), found,
                                                                    seq, kept)
        if len(recent) > _RECENT:
            del recent[next(iter(recent))]

    def _dtype_facts(self, tensor: torch.Tensor) -> tuple[torch.Tensor, str, int, bool]:
        """The ring seen as this dtype, the dtype's name, its item size, and whether a
        contiguous tensor of it is its bytes as stored (complex tensors may carry a lazy
        conjugate or negation bit, which a byte copy would drop)."""
        dtype = tensor.dtype
        return (self._ring.view(dtype), dtype_name(dtype), tensor.element_size(),
                not dtype.is_complex)

    def _pin(self, device: torch.device) -> None:
        """Page-lock the ring (for asynchronous copies) and give the recorder its fence."""
        buffer = self.recorder.ring.buffer
        status = torch.cuda.cudart().cudaHostRegister(buffer.ctypes.data, buffer.nbytes, 0)
        self._pinned = int(status) == 0  # unpinned, the copies still run, synchronously
        self._fenced = True

        def fence():
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return event.synchronize

        self.recorder.fence = fence

    def release(self) -> None:
        """Unpin the ring (after the recorder has closed)."""
        self.__dict__.pop("tensor", None)   # the bound method that made a reference cycle
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.recorder.ring.buffer.ctypes.data)
            self._pinned = False

    def value(self, step: int, pass_: str, site: str, role: str, arg: str, value: Any) -> None:
        self.recorder.submit(step, pass_, site, role, arg, "", (), value=value_json(value))

    def any(self, step: int, pass_: str, site: str, role: str, arg: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensor(step, pass_, site, role, arg, value)
        else:
            self.value(step, pass_, site, role, arg, value)


# Tensors from this size get their statistics on the capturing thread (see Stager.tensor); the
# smaller ones are batched on the statistics thread, where a kernel call per tensor would cost.
INLINE_STATS_BYTES = 2**20
# How many large tensors' statistics are kept for a repeat: the input of a layer is the
# output recorded just before (or a few records before, after a container's records).
_RECENT = 4

_memmove = ctypes.memmove  # releases the GIL while it copies, like any ctypes call
# The same C function called without releasing the GIL. Releasing it hands the GIL to a writer
# thread, and the capturing thread then waits for it back: with thousands of small tensors a
# step those hand-overs, not the copies, were most of the cost. Copies up to this size (~20 us)
# keep the GIL; larger ones let the writer threads run meanwhile.
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)
_HOLD_GIL_BYTES = 256 * 2**10
# Tensor types whose data_ptr is their own storage: a subclass (a distributed or fake tensor) may
# not be, and takes torch's copy.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _bytes_of(tensor: torch.Tensor, nbytes: int) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a numpy array sharing its memory."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr()))


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    # No copy for a contiguous CPU tensor: Recorder.submit waits until these bytes are written.
    cpu = tensor.cpu().contiguous()
    if cpu.dtype == torch.bfloat16:
        return cpu.view(torch.uint16).numpy()
    try:
        return cpu.numpy()
    except TypeError:  # dtypes numpy lacks (float8 ...): raw bytes
        return cpu.view(torch.uint8).numpy()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
