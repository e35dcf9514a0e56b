"""Cases for the multi-rank capture tests (loaded by spec in spawned rank processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from reference_models import op_bugs
from reference_models import tensor_parallel as tp
from reference_models.porting import port_case


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


def tp_gelu_tanh_on_rank_one():
    """The tensor-parallel port whose block-0 GELU uses the tanh approximation on rank 1 only
    (a rank that runs other code on its shard): the error lies in rank 1's part only."""
    def mlp(index: int, rank: int, world: int) -> nn.Module:
        module = tp.ParallelMLP(rank, world)
        if index == 0 and rank == 1:
            module.act = nn.GELU(approximate="tanh")
        return module

    case = tp._port("tp_gelu_tanh_on_rank_one", mlp)
    case.name = "tests.dist_cases:tp_gelu_tanh_on_rank_one"
    return case


def tp_port_own_weights():
    """The faithful tensor-parallel port with weights of its own (another seed): it matches
    the reference only once `capture --weights-from REF --map` loads each rank's shards."""
    rank, world = tp.rank_and_world()

    def build(reference: nn.Module) -> nn.Module:
        torch.manual_seed(1234)
        return tp.TinyGPT(lambda index: tp.ParallelMLP(rank, world))

    return port_case(tp.reference, build, "tests.dist_cases:tp_port_own_weights")


# --- Ctrl-C at chosen points of a multi-rank capture (each patches its own rank process) -------

def _interrupt(whom: str) -> None:
    """SIGINT as a user sends it: to the terminal's whole process group (the command and its
    ranks), to the command alone, or to this rank alone; then a wait that the interrupt ends
    (in short sleeps: a signal the kernel gives one of gloo's threads wakes no long sleep)."""
    import os
    import signal
    import time

    if whom == "group":
        os.killpg(os.getpgrp(), signal.SIGINT)
    else:
        os.kill(os.getppid() if whom == "command" else os.getpid(), signal.SIGINT)
    for _ in range(1200):  # 60 s: the interrupt lands here, or the command stops this rank
        time.sleep(0.05)


def _after_manifest(whom: str, rank: int, name: str):
    """The op-level model; once the manifest is published (rank 0 wrote it, and every rank
    passed the barrier after it), rank ``rank`` interrupts ``whom``."""
    barrier = dist.barrier

    def interrupting_barrier(*args, **kwargs):
        barrier(*args, **kwargs)
        if dist.get_rank() == rank:
            _interrupt(whom)

    dist.barrier = interrupting_barrier
    case = op_bugs.reference()
    case.name = name
    return case


def interrupt_group_after_manifest():
    return _after_manifest("group", 0, "tests.dist_cases:interrupt_group_after_manifest")


def interrupt_rank_one_after_manifest():
    return _after_manifest("self", 1, "tests.dist_cases:interrupt_rank_one_after_manifest")


def _mid_run(whom: str, name: str):
    """The op-level model; rank 0's loss at step 1 interrupts ``whom`` and waits for it."""
    case = op_bugs.reference()
    loss_fn = case.loss_fn
    calls = []

    def loss(output):
        calls.append(1)
        if dist.get_rank() == 0 and len(calls) == 2:
            _interrupt(whom)
        return loss_fn(output)

    case.loss_fn = loss
    case.name = name
    return case


def interrupt_group_mid_run():
    return _mid_run("group", "tests.dist_cases:interrupt_group_mid_run")


def interrupt_command_mid_run():
    return _mid_run("command", "tests.dist_cases:interrupt_command_mid_run")


def interrupt_rank_zero_after_manifest():
    return _after_manifest("self", 0, "tests.dist_cases:interrupt_rank_zero_after_manifest")
