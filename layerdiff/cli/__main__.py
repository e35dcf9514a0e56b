"""``python -m layerdiff.cli``: as before the command line became a package (``python -m
layerdiff`` is the usual spelling)."""

import sys

from layerdiff.cli import main

sys.exit(main())
