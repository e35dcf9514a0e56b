"""m.mark() called after the forward of a step the monitor does not record (off the `every`
grid) marks the next step, as docs/monitor.md says, not the step whose forward already ran
unhooked (which recorded only its gradients, at the root, and left the next step out)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import layerdiff


def _train(path, mark_after_forward_at: int, steps: int = 1) -> layerdiff.Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with layerdiff.monitor(model, path, every=5, optimizer=opt) as m:
        for step in range(12):
            loss = model(torch.randn(3, 4)).square().mean()
            if step == mark_after_forward_at:
                m.mark(steps=steps)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return layerdiff.open_trace(path)


@pytest.mark.parametrize("steps", [1, 2])
def test_a_mark_after_an_unrecorded_forward_marks_the_next_step(tmp_path, steps):
    trace = _train(tmp_path / "m.h5", mark_after_forward_at=7, steps=steps)
    marked = list(range(8, 8 + steps))
    assert trace.meta["recorded_steps"] == sorted({0, 5, 10, *marked})
    assert trace.meta["monitor"]["full_steps"] == marked
    index = trace.index
    for step in marked:  # the whole step, its forward included, with its tensors
        rows = index[index["step"] == step]
        assert {"input", "output", "weight", "weight_grad"} <= set(rows["role"])
        assert (rows["segment"] >= 0).all()
    assert 7 not in set(index["step"])
