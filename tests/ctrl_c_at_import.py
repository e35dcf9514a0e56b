"""A case module whose import is interrupted: Ctrl-C while the case loads, at the start of a
capture (tests/test_capture_refusals.py)."""

raise KeyboardInterrupt
