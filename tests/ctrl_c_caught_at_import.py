"""A case module whose import is interrupted inside a library that catches the Ctrl-C and
raises its own error, as h5py's converters raise TypeError (tests/test_capture_refusals.py)."""

try:
    raise KeyboardInterrupt
except KeyboardInterrupt:
    raise TypeError("Operation not defined for data type class")  # noqa: B904 - as h5py does
