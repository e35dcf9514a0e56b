"""The trace format: schema, writers and reader. Needs h5py and numpy, never torch."""

from layerdiff.trace.reader import Trace, open_trace
from layerdiff.trace.recorder import DEFAULT_QUEUE_BYTES, Recorder
from layerdiff.trace.writer import TraceWriter

__all__ = ["DEFAULT_QUEUE_BYTES", "Recorder", "Trace", "TraceWriter", "open_trace"]
