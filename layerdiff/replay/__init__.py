"""Replay (each port layer on the reference's inputs), swap (port layers inside the
reference), bisect (the smallest set of port layers that breaks it) and an interactive session.
"""

from layerdiff.replay.bisect import BisectResult, bisect
from layerdiff.replay.replay import ReplayResult, replay
from layerdiff.replay.session import Session
from layerdiff.replay.swap import Swapper, SwapResult, swap

__all__ = ["BisectResult", "ReplayResult", "Session", "SwapResult", "Swapper", "bisect",
           "replay", "swap"]
