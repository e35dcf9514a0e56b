"""Replay (each port layer on the reference's inputs), swap (port layers inside the
reference), bisect (the smallest set of port layers that breaks it) and an interactive session.

``layerdiff.replay`` is both this package and the function users call
(``layerdiff.replay(reference, port)``): the module is callable, with the function's signature
(see :mod:`layerdiff.callable_module`), so that both spellings work.
"""

from layerdiff.callable_module import make_callable
from layerdiff.replay.bisect import BisectResult, bisect
from layerdiff.replay.replay import LocalVerdict, ReplayOutcome, ReplayResult, replay
from layerdiff.replay.session import Session
from layerdiff.replay.swap import SwapDirection, Swapper, SwapResult, swap

__all__ = ["BisectResult", "LocalVerdict", "ReplayOutcome", "ReplayResult", "Session",
           "SwapDirection", "SwapResult", "Swapper", "bisect", "replay", "swap"]

make_callable(__name__, replay)
