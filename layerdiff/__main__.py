"""``python -m layerdiff``: the same command line as ``layerdiff`` (for torchrun, subprocesses)."""

from layerdiff.cli import main

main(prog_name="layerdiff")
