"""``python -m layerdiff``: the same command line as ``layerdiff`` (for torchrun, subprocesses)."""

from layerdiff.cli import run

run()
