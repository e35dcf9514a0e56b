"""The random state of a run: saved, restored, and seeded without touching what it need not.

A diagnostic that runs a case's model again (batch independence, find-nan's replay of the
failing step, replay's two seeded calls) must leave the caller's random state as it found it,
and its own runs must draw the same numbers (dropout masks) each time. Four generators hold
that state: python's ``random``, numpy's global one, torch's CPU generator and the CUDA
generator of each device. CUDA's are read and written only when CUDA is already initialised,
or for the devices named: touching them otherwise would initialise CUDA (or, through
``torch.manual_seed``, queue a lazy seeding of every device, a stack trace each time on a
machine without one).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RandomState:
    """What :func:`save` read: every generator's state, to :meth:`restore` later."""

    python: Any
    numpy: Any
    torch: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]   # (device, state) of the devices saved

    def restore(self) -> None:
        """Put every saved generator back as it was when saved."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)


def save(devices: Iterable[int] = ()) -> RandomState:
    """The state of python's, numpy's and torch's CPU generator, and of the CUDA generators of
    ``devices`` and of every device when CUDA is initialised already."""
    cuda = set(devices)
    if torch.cuda.is_initialized():
        cuda.update(range(torch.cuda.device_count()))
    return RandomState(random.getstate(), np.random.get_state(), torch.get_rng_state(),
                       tuple((d, torch.cuda.get_rng_state(d)) for d in sorted(cuda)))


@contextmanager
def preserved(devices: Iterable[int] = ()) -> Iterator[RandomState]:
    """Run the block, then restore every generator :func:`save` reads, however the block
    ended."""
    state = save(devices)
    try:
        yield state
    finally:
        state.restore()


def seed_torch(seed: int, devices: Iterable[int] = ()) -> None:
    """Seed torch's CPU generator and the CUDA generators of ``devices`` (indices), no other:
    ``torch.manual_seed`` also queues the seeding of every CUDA device."""
    torch.default_generator.manual_seed(seed)
    for device in devices:
        torch.cuda.default_generators[device].manual_seed(seed)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device), so that dropout and data
    draws repeat exactly: what a case runs from."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def seeded(seed: int, devices: Iterable[int] = ()) -> Iterator[None]:
    """Run the block from torch generators seeded with ``seed`` (CPU and ``devices``), then
    put back every generator :func:`save` reads: the same draws each time, the caller's
    state untouched."""
    devices = list(devices)
    with preserved(devices):
        seed_torch(seed, devices)
        yield


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The CUDA device indices ``tensors`` live on, sorted (a model's parameters and
    buffers: the generators its dropout draws from)."""
    return sorted({t.device.index or 0 for t in tensors if t.is_cuda})
