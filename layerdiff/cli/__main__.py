"""``python -m layerdiff.cli``: as before the command line became a package (``python -m
layerdiff`` is the usual spelling)."""

from layerdiff.cli import run

run()
