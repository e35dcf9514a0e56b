"""The one place that reads a trace's bytes straight from the file, past h5py: ranges of
plain segments read with ``os.preadv`` on the descriptor HDF5 holds, or mapped. The diff's
measured fast path (docs/benchmarks.md); everything else goes through
:class:`layerdiff.trace.segments.SegmentReader`."""

from __future__ import annotations

import contextlib
import mmap
import os
import sys

import h5py
import numpy as np

from layerdiff.trace.segments import SegmentReader, segment_dataset

# Linux's number for it (named in Python from 3.13); elsewhere the pages fault in on first use
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ",
                              22 if sys.platform.startswith("linux") else None)


class DirectReader:
    """SegmentReader's ``read``, with ranges of plain segments read by ``os.preadv`` on the
    file descriptor HDF5 itself holds, at the offset HDF5 gives for the segment.

    A segment is a contiguous, unfiltered 1-D uint8 dataset: its bytes lie in the file as
    they are, so the read gives the same bytes as h5py's ``read_direct``, without its ~100 µs
    of Python per call (measured on a warm page cache: 7-8 GB/s in 1 MiB reads against h5py's
    2.7-3.1). Small tensors are read one by one too (~9 µs for 4 KiB): SegmentReader's 4 MiB
    window pays off for runs of small tensors, but where small tensors lie between large ones
    (a layer's bias between its weights) every window read copies 4 MiB for a few KiB, which
    cost the bench's 2 GB diff 0.36 s of CPU. Anything else (another HDF5 driver, a chunked
    or filtered segment, a short read, a range the segment does not hold) goes through
    SegmentReader, which reads it or refuses it as before.

    It reaches HDF5's descriptor and the segments' file offsets through the trace's own
    :class:`SegmentReader` (whose ``segment_dataset`` refuses links, external and virtual
    storage first), and only for what HDF5 itself reports a contiguous, unfiltered dataset
    of this very file: the one place that reads the file's bytes past h5py, kept because it
    is the measured fast path of every diff (docs/benchmarks.md).

    ``mapped`` goes one step further and maps those bytes, so that nothing is copied out of
    the page cache: a 2 GB diff's reads cost 0.5 s of CPU per GB compared in ``preadv``
    copies (1.4-2 GB/s with the digest, this machine's memory being slow), against 11-12 GB/s
    over 8 MiB maps. The maps are private (copy-on-write) so that numpy sees writable arrays
    (the compiled kernels' signatures), and nothing is ever written to them. A map is closed
    when the last array over it goes. One hazard remains that a read does not have: a file
    truncated by another process while it is mapped ends the process with SIGBUS.
    """

    def __init__(self, segments: SegmentReader) -> None:
        self.segments = segments
        self.path = segments.path
        self.digest_algorithm = segments.digest_algorithm
        self._h5 = segments.h5
        self._fd = _descriptor(segments.h5)
        self._places: dict[int, tuple[int, int] | None] = {}

    def read(self, segment: int, offset: int, nbytes: int, out: np.ndarray) -> None:
        """Fill ``out[:nbytes]`` with bytes ``offset .. offset + nbytes`` of the segment."""
        if self._fd is not None:
            place = self._place(segment)
            if place is not None and offset >= 0 and offset + nbytes <= place[1]:
                view = memoryview(out)[:nbytes]
                with contextlib.suppress(OSError):
                    if os.preadv(self._fd, [view], place[0] + offset) == nbytes:
                        return
        self.segments.read(segment, offset, nbytes, out)

    def mapped(self, segment: int, offset: int, nbytes: int) -> np.ndarray | None:
        """Bytes ``offset .. offset + nbytes`` of a plain segment as uint8 over a map of the
        file, or None where they cannot be mapped (then ``read`` them)."""
        if self._fd is None or nbytes <= 0:
            return None
        place = self._place(segment)
        if place is None or offset < 0 or offset + nbytes > place[1]:
            return None
        start = place[0] + offset
        if start % 8:  # numpy and the kernels want aligned elements: a buffer gives them
            return None
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        try:  # mmap refuses a range past the end of the file (ValueError): read it instead
            window = mmap.mmap(self._fd, start + nbytes - aligned, access=mmap.ACCESS_COPY,
                               offset=aligned)
        except (OSError, ValueError):
            return None
        if _MADV_POPULATE_READ is not None:
            with contextlib.suppress(OSError):  # Linux 5.14+: fault the pages in here, on
                window.madvise(_MADV_POPULATE_READ)  # this thread, not in the caller's kernel
        return np.frombuffer(window, np.uint8, nbytes, start - aligned)

    def _place(self, segment: int) -> tuple[int, int] | None:
        """(file offset, size) of a segment whose bytes lie in the file as they are."""
        if segment not in self._places:
            self._places[segment] = None
            dataset = segment_dataset(self._h5, segment, self.path)  # refuses what it must
            with contextlib.suppress(Exception):
                plist = dataset.id.get_create_plist()
                start = dataset.id.get_offset()
                size = int(dataset.shape[0])
                if (plist.get_layout() == h5py.h5d.CONTIGUOUS and plist.get_nfilters() == 0
                        and start is not None and dataset.id.get_storage_size() == size):
                    self._places[segment] = (int(start), size)
        return self._places[segment]


def _descriptor(h5: h5py.File) -> int | None:
    """The descriptor of a file HDF5 opened with its default (POSIX) driver, else None."""
    with contextlib.suppress(Exception):
        if h5.driver == "sec2" and hasattr(os, "preadv"):
            fd = h5.id.get_vfd_handle()
            if isinstance(fd, int) and fd >= 0:
                return fd
    return None
