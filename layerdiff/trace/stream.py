"""A tensor of a trace read in bounded chunks, each whole tensor checked against the digest
its index row holds: for readers that go through a tensor once (the trace browser's histograms)
without holding it whole."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pandas as pd

from layerdiff.errors import TraceError
from layerdiff.trace import digest, schema
from layerdiff.trace.reader import Trace
from layerdiff.trace.segments import decode

CHUNK_BYTES = 1 << 20


class TensorStream:
    """Reads tensors of one trace in bounded chunks, each checked against its index digest."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._reader = trace.segments()
        self._buffer = np.empty(CHUNK_BYTES, np.uint8)

    def chunks(self, row: pd.Series) -> Iterator[np.ndarray]:
        """The tensor's values in chunks (floats as stored, valid until the next chunk; other
        numbers as float64); raises TraceError when the bytes do not match the digest the index
        holds for them."""
        dtype = str(row["dtype"])
        itemsize = schema.numpy_dtype(dtype).itemsize
        total = int(row["nbytes"])
        step = max(itemsize, CHUNK_BYTES // itemsize * itemsize)
        hasher = digest.hasher(self.trace.digest_algorithm)
        for start in range(0, total, step):
            count = min(step, total - start)
            self._reader.read(int(row["segment"]), int(row["offset"]) + start, count,
                              self._buffer)
            hasher.update(self._buffer[:count])
            values = decode(self._buffer, dtype, count // itemsize)
            yield values if values.dtype.kind == "f" else values.astype(np.float64)
        if row["digest"] and hasher.hexdigest() != row["digest"]:
            raise TraceError(f"{self.trace.path}: the data of {row['site']} {row['role']} "
                             f"{row['arg']} (step {row['step']}) does not match its digest; the "
                             "file is damaged, capture it again")
