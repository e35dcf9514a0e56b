"""Cases for the multi-rank capture tests (loaded by spec in spawned rank processes)."""

from __future__ import annotations

import torch.distributed as dist

from reference_models import op_bugs


def crash_on_rank_one():
    """The op-level model, whose loss raises on rank 1 at step 1: a rank that fails mid-run."""
    case = op_bugs.reference()
    loss_fn = case.loss_fn
    calls = []

    def loss(output):
        calls.append(1)
        if dist.is_initialized() and dist.get_rank() == 1 and len(calls) == 2:
            raise RuntimeError("rank 1 lost its device")
        return loss_fn(output)

    case.loss_fn = loss
    case.name = "tests.dist_cases:crash_on_rank_one"
    return case
