"""layerdiff.monitor in a plain training loop: a port that departs from its reference only from
step 20 of 50 is named at that step and at the layer whose code differs; two runs of one model
agree; the window keeps the last steps; a mark keeps a step's tensors; a loop that raises
leaves a file readers refuse unless asked; steps off the grid run without hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import layerdiff
from layerdiff.errors import CaptureError, TraceError

STEPS = 50
DEPART = 20


class Norm(nn.LayerNorm):
    """The reference's layer norm."""


class FusedNorm(nn.LayerNorm):
    """A port's layer norm whose 'fused' path, switched on after a warm-up of DEPART calls,
    takes the wrong epsilon: equal to the reference until then, apart from then on."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= DEPART:
            return super().forward(x)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, eps=1e-2)


class Net(nn.Module):
    def __init__(self, norm: type[nn.LayerNorm]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 16)
        self.norm = norm(16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # small activations: the variance is near the wrong epsilon, so it shows
        h = torch.tanh(self.inp(x)) * 0.05
        return self.out(torch.relu(self.hidden(self.norm(h))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def train(path, norm: type[nn.LayerNorm] = Norm, *, steps: int = STEPS, raise_at: int = -1,
          mark_at: int = -1, lr_slip_at: int = -1, **options):
    model = Net(norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with layerdiff.monitor(model, path, **options) as m:
        for step in range(steps):
            if step == lr_slip_at:  # a port's schedule that moves the rate a step early
                opt.param_groups[0]["lr"] = 0.09
            if step == mark_at:
                m.mark()
            if step == raise_at:
                raise RuntimeError("loss is NaN")
            x, y = _batch(step)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            m.step()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("monitor")
    return {"ref": train(folder / "ref.h5"), "again": train(folder / "again.h5"),
            "port": train(folder / "port.h5", FusedNorm),
            "schedule": train(folder / "schedule.h5", lr_slip_at=DEPART)}


def test_a_port_departing_at_step_20_is_named_there_at_its_layer(runs):
    found = layerdiff.diff(runs["ref"], runs["port"])
    assert not found
    first = found.origins[0]
    assert (first.step, first.site, first.role) == (DEPART, "norm#0", "output")
    assert all(o.step == DEPART for o in found.origins)
    assert {o.site for o in found.origins} == {"norm#0"}


def test_an_optimizer_step_that_departs_at_step_20_shows_in_the_weights_of_step_21(runs):
    """Weights are recorded as the forward sees them: the optimizer step that ends step 20
    is seen at the start of step 21, and named as the optimizer's."""
    found = layerdiff.diff(runs["ref"], runs["schedule"])
    assert not found
    first = found.origins[0]
    assert (first.step, first.role) == (DEPART + 1, "weight")
    assert "optimizer step" in first.reason


def test_runs_parting_between_recorded_steps_are_not_blamed_on_the_optimizer(tmp_path):
    """Recorded every 7 steps, the port's weights are first seen apart at step 21; the steps
    between were not recorded, so the reason says so instead of naming the optimizer."""
    ref = train(tmp_path / "ref7.h5", every=7)
    port = train(tmp_path / "port7.h5", FusedNorm, every=7)
    first = layerdiff.diff(ref, port).origins[0]
    assert (first.step, first.role) == (21, "weight")
    assert "first step recorded after step 14" in first.reason
    assert "not recorded" in first.reason and "optimizer step differs" not in first.reason


def test_runs_recorded_at_different_steps_are_compared_where_both_are_and_warned(runs, tmp_path):
    every5 = train(tmp_path / "every5.h5", every=5)
    found = layerdiff.diff(runs["ref"], every5)
    assert found  # every step of the reference, every 5th of the same model: those agree
    assert any("only the 10 both recorded were compared (0, 5, 10, 15, 20, 25 ...)" in warning
               for warning in found.meta["warnings"])
    assert not layerdiff.diff(runs["ref"], runs["again"]).meta["warnings"]


def test_two_runs_of_one_model_agree(runs):
    found = layerdiff.diff(runs["ref"], runs["again"])
    assert found
    assert not found.origins


def test_the_trace_is_a_summary_trace_of_every_step(runs):
    trace = layerdiff.open_trace(runs["ref"])
    assert trace.summary
    index = trace.index
    assert sorted(index["step"].unique()) == list(range(STEPS))
    step = index[index["step"] == 3]
    roles = set(step["role"])
    assert {"input", "output", "weight", "weight_grad"} <= roles
    assert (step["segment"] == -1).all()
    grads = step[step["role"] == "weight_grad"]
    assert set(grads["site"] + "." + grads["arg"]) >= {"norm#0.weight", "out#0.bias"}


def test_every_k_records_those_steps_and_runs_the_others_without_hooks(tmp_path):
    model = Net(Norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = []
    with layerdiff.monitor(model, tmp_path / "k.h5", every=4, optimizer=opt) as m:
        for step in range(10):
            hooked.append(bool(model.norm._forward_hooks))
            x, y = _batch(step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with pytest.raises(CaptureError, match="counts steps from its optimizer"):
            m.step()
    assert hooked == [step % 4 == 0 for step in range(10)]
    assert not model.norm._forward_hooks and not model.norm._forward_pre_hooks
    index = layerdiff.open_trace(tmp_path / "k.h5").index
    assert sorted(index["step"].unique()) == [0, 4, 8]


def test_the_window_keeps_the_last_steps_only(tmp_path):
    path = train(tmp_path / "w.h5", steps=20, every=2, window=3)
    trace = layerdiff.open_trace(path)
    assert sorted(trace.index["step"].unique()) == [14, 16, 18]
    assert sorted(trace.sites["step"].unique()) == [14, 16, 18]
    assert trace.meta["monitor"]["dropped_steps"] == 7
    # show lists the window, and its sites table shows the window's first step, not step 0
    from click.testing import CliRunner

    from layerdiff.cli import main

    shown = CliRunner().invoke(main, ["show", str(path), "--by-site"])
    assert shown.exit_code == 0 and "3 steps recorded: 14, 16, 18" in shown.output
    assert "norm#0" in shown.output


def test_a_mark_keeps_that_steps_tensors(tmp_path):
    path = train(tmp_path / "m.h5", steps=12, every=5, mark_at=7)
    trace = layerdiff.open_trace(path)
    assert not trace.summary
    index = trace.index
    assert sorted(index["step"].unique()) == [0, 5, 7, 10]
    kept = index[index["segment"] >= 0]
    assert set(kept["step"]) == {7}
    assert len(kept) == (index["step"] == 7).sum()
    row = kept[(kept["site"] == "norm#0") & (kept["role"] == "output")].iloc[0]
    data = trace.read(row)  # checked against its digest and statistics as it is read
    assert np.isclose(float(np.linalg.norm(data)), row["l2"], rtol=1e-5)


def test_a_loop_that_raises_leaves_a_file_readers_refuse(tmp_path):
    path = tmp_path / "crash.h5"
    with pytest.raises(RuntimeError, match="loss is NaN"):
        train(path, steps=10, raise_at=6)
    assert not path.exists()
    partial = tmp_path / "crash.h5.partial"
    with pytest.raises(TraceError, match=r"incomplete|not complete"):
        layerdiff.open_trace(partial)
    trace = layerdiff.open_trace(partial, allow_incomplete=True)
    assert sorted(trace.index["step"].unique()) == list(range(6))


def test_bad_arguments_are_refused_in_one_sentence(tmp_path):
    with pytest.raises(CaptureError, match="every=0 is not a whole number"):
        layerdiff.monitor(Net(Norm), tmp_path / "x.h5", every=0)
    with pytest.raises(CaptureError, match=r"not a torch\.nn\.Module"):
        layerdiff.monitor(object(), tmp_path / "x.h5")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_statistics_on_the_host_and_through_the_device_arenas_agree(dtype):
    """A GPU's path (device_stats.py's batched reductions, read when the file is written)
    gives the host path's statistics: run on CPU tensors, as CI can."""
    from layerdiff.monitor.tensor_stats import StepStatistics, resolve
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(shape, generator=generator).to(dtype)
               for shape in ((3, 5), (64, 300), (7,), (2, 40000))]
    tensors[1][0, 0] = float("nan")
    tensors[2][3] = float("inf")
    found = {}
    for on_device in (False, True):
        stats = StepStatistics(reduce_on_device=on_device)
        slots = [stats.add(t) for t in tensors[:2]] + stats.add_many(tensors[2:])
        stats.finish()
        found[on_device] = [resolve(stats.results[s]) for s in slots]
    for host, device in zip(found[False], found[True], strict=True):
        assert (host.nan, host.inf, host.min, host.max) == (device.nan, device.inf, device.min,
                                                            device.max)
        assert np.allclose([host.mean, host.std, host.l2], [device.mean, device.std, device.l2],
                           rtol=1e-9, equal_nan=True)
