"""Replay (each port layer on the reference's inputs), swap (port layers inside the
reference), bisect (the smallest set of port layers that breaks it) and an interactive session.
"""

from layerdiff.replay.replay import local_table, replay

__all__ = ["local_table", "replay"]
