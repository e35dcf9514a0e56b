"""Whether 2 local gloo processes can run here, and a free TCP port for their rendezvous."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist


def gloo_unavailable() -> str | None:
    """Why 2 local gloo processes cannot run here, or None."""
    if not (dist.is_available() and dist.is_gloo_available()):
        return "this torch build has no gloo backend"
    try:
        free_port()
    except OSError as exc:
        return f"cannot bind a TCP port on 127.0.0.1 for gloo ({exc})"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


needs_gloo = pytest.mark.skipif(gloo_unavailable() is not None,
                                reason=f"2-process gloo tests: {gloo_unavailable()}")
