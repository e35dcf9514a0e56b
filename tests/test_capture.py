"""Torch capture: what it records is right, and recording changes nothing."""

from __future__ import annotations

import errno
import json

import numpy as np
import pytest
import torch

from layerdiff import CaptureError, capture, open_trace, run_case
from layerdiff.trace.h5file import TraceFile
from tests import tiny_cases


def _tensor(trace, site, role, arg="0", step=0):
    index = trace.index
    rows = index[(index["site"] == site) & (index["role"] == role) & (index["arg"] == arg)
                 & (index["step"] == step)]
    assert len(rows) == 1, f"{site} {role} {arg} step {step}: {len(rows)} rows"
    return trace.read(rows.iloc[0])


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_capture_changes_no_number(tmp_path):
    """Outputs, losses, gradients and weights after 3 steps (dropout on) are bit-identical."""
    plain = tiny_cases.tiny_steps()
    result = run_case(plain)
    captured = tiny_cases.tiny_steps()
    capture(captured, tmp_path / "t.h5")
    again = run_case(tiny_cases.tiny_steps())
    assert [float(x) for x in result.losses] == [float(x) for x in again.losses]
    pairs = zip(plain.model.named_parameters(), captured.model.parameters(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b), name
        assert torch.equal(a.grad, b.grad), name
    with open_trace(tmp_path / "t.h5") as trace:
        losses = [float(_tensor(trace, "<loss>#0", "output", step=s)) for s in range(3)]
    assert losses == [float(x) for x in result.losses]


def test_records_every_call_with_its_roles(trace_path):
    capture(tiny_cases.tiny(), trace_path)
    with open_trace(trace_path) as trace:
        sites = trace.sites
        assert {"block#0", "block#1", "block.lin1#0", "block.lin1#1", "heads.a#0",
                "<root>#0"} <= set(sites["site"])
        assert sites.set_index("site").loc["block.lin1#1", "parent"] == "block#1"
        roles = trace.index.groupby("site")["role"].agg(set)
        assert roles["block.lin1#0"] == {"input", "output", "weight", "grad_output",
                                         "grad_input", "weight_grad"}
        # weights are recorded once per step, at the module's first call
        assert "weight" not in roles["block.lin1#1"]
        # keyword and non-tensor arguments are kept, nested outputs flattened
        block_args = set(trace.index.query("site == 'block#0' and role == 'input'")["arg"])
        assert block_args == {"0", "scale", "mask"}
        scale = trace.index.query("site == 'block#0' and arg == 'scale'").iloc[0]
        assert scale["kind"] == "value" and json.loads(scale["value"]) == 0.5
        head_outputs = trace.index.query("site == 'heads#0' and role == 'output'")
        assert list(head_outputs["arg"]) == ["logits", "aux.0", "aux.1"]
        assert json.loads(head_outputs.iloc[2]["value"]) == 6


def test_inputs_are_recorded_before_in_place_ops(trace_path):
    case = tiny_cases.tiny()
    capture(case, trace_path)
    with open_trace(trace_path) as trace:
        lin1_out = _tensor(trace, "block.lin1#0", "output")
        relu_in = _tensor(trace, "block.act#0", "input")
        relu_out = _tensor(trace, "block.act#0", "output")
        assert (relu_in < 0).any(), "ReLU(inplace=True) input was recorded after it ran"
        np.testing.assert_array_equal(relu_in, lin1_out)
        np.testing.assert_array_equal(relu_out, np.maximum(relu_in, 0))
        # `h += x` inside Block.forward must not leak into the dropout's recorded output
        drop_out = _tensor(trace, "block.drop#0", "output")
        block_in = _tensor(trace, "block#0", "input")
        mask = _tensor(trace, "block#0", "input", arg="mask")
        block_out = _tensor(trace, "block#0", "output")
        np.testing.assert_allclose(block_out, (drop_out * mask + block_in) * 0.5, rtol=1e-6)


def test_gradients_match_autograd(trace_path):
    case = tiny_cases.tiny()
    case.model.eval()  # no dropout: the check below recomputes the forward independently
    capture(case, trace_path)
    with open_trace(trace_path) as trace:
        # grad_input of a Linear is grad_output @ W
        g_out = _tensor(trace, "block.lin1#0", "grad_output")
        weight = _tensor(trace, "block.lin1#0", "weight", arg="weight")
        np.testing.assert_allclose(_tensor(trace, "block.lin1#0", "grad_input"),
                                   g_out @ weight, rtol=1e-5, atol=1e-7)
        # an in-place ReLU's gradient is masked by its output
        relu_out = _tensor(trace, "block.act#0", "output")
        np.testing.assert_array_equal(_tensor(trace, "block.act#0", "grad_input"),
                                      _tensor(trace, "block.act#0", "grad_output")
                                      * (relu_out > 0))
        # block#1 consumes block#0's output and nothing else does: same gradient, to the bit
        np.testing.assert_array_equal(_tensor(trace, "block#1", "grad_input"),
                                      _tensor(trace, "block#0", "grad_output"))
        # the gradient arriving at the LayerNorm's output, against torch.autograd.grad
        fresh = tiny_cases.tiny()
        fresh.model.eval()
        keep = {}
        fresh.model.norm.register_forward_hook(lambda m, a, o: keep.setdefault("y", o))
        loss = fresh.loss_fn(fresh.call_model())
        (expected,) = torch.autograd.grad(loss, keep["y"])
        np.testing.assert_allclose(_tensor(trace, "norm#0", "grad_output"), expected.numpy(),
                                   rtol=1e-6, atol=1e-9)
        # weight gradients are the parameters' .grad after backward
        for module in ("heads.a", "embed"):
            for name, param in case.model.get_submodule(module).named_parameters():
                recorded = _tensor(trace, f"{module}#0", "weight_grad", name)
                assert torch.equal(torch.from_numpy(recorded), param.grad)


def test_loss_scale_amplifies_recorded_gradients_only(tmp_path):
    scale = 2.0 ** 20
    plain = tiny_cases.tiny_steps()
    run_case(plain)
    scaled = tiny_cases.tiny_steps()
    capture(scaled, tmp_path / "s.h5", loss_scale=scale)
    reference = tiny_cases.tiny_steps()
    capture(reference, tmp_path / "r.h5")
    for a, b in zip(plain.model.parameters(), scaled.model.parameters(), strict=True):
        assert torch.equal(a, b), "a power-of-two loss scale must leave training bit-identical"
    with open_trace(tmp_path / "s.h5") as s, open_trace(tmp_path / "r.h5") as r:
        assert s.loss_scale == scale and r.loss_scale == 1.0
        for site, role, arg in [("heads.a#0", "weight_grad", "weight"),
                                ("block.lin2#0", "grad_input", "0")]:
            np.testing.assert_array_equal(_tensor(s, site, role, arg, step=2),
                                          _tensor(r, site, role, arg, step=2) * scale)
        np.testing.assert_array_equal(_tensor(s, "<loss>#0", "output"),
                                      _tensor(r, "<loss>#0", "output"))


def test_non_power_of_two_loss_scale_keeps_training_within_rounding(tmp_path):
    plain = tiny_cases.tiny_steps()
    run_case(plain)
    scaled = tiny_cases.tiny_steps()
    capture(scaled, tmp_path / "s.h5", loss_scale=1e6)
    for a, b in zip(plain.model.parameters(), scaled.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_every_record_carries_its_step(trace_path):
    capture(tiny_cases.tiny_steps(), trace_path)
    with open_trace(trace_path) as trace:
        assert sorted(trace.index["step"].unique()) == [0, 1, 2]
        w0 = _tensor(trace, "heads.a#0", "weight", "weight", step=0)
        w1 = _tensor(trace, "heads.a#0", "weight", "weight", step=1)
        assert not np.array_equal(w0, w1), "the optimizer step must show in the next weights"
        assert trace.meta["steps"] == 3 and trace.meta["versions"]["torch"] == torch.__version__
        assert trace.meta["default_dtype"] == "float32"
        assert trace.meta["deterministic_algorithms"] is False


def test_steps_option_overrides_the_case(trace_path):
    capture(tiny_cases.tiny_steps(), trace_path, steps=2)
    with open_trace(trace_path) as trace:
        assert sorted(trace.index["step"].unique()) == [0, 1]


def test_summary_capture_matches_full_statistics(tmp_path):
    capture(tiny_cases.tiny(), tmp_path / "full.h5")
    capture(tiny_cases.tiny(), tmp_path / "sum.h5", summary=True)
    with open_trace(tmp_path / "full.h5") as full, open_trace(tmp_path / "sum.h5") as summ:
        assert summ.summary and (summ.index["segment"] == -1).all()
        assert list(summ.index["digest"]) == list(full.index["digest"])
    assert (tmp_path / "sum.h5").stat().st_size < (tmp_path / "full.h5").stat().st_size


def test_tiny_queue_and_oversized_tensors_record_the_same_bytes(tmp_path):
    capture(tiny_cases.big_tensor(), tmp_path / "a.h5")
    capture(tiny_cases.big_tensor(), tmp_path / "b.h5", queue_bytes=64 * 1024)
    with open_trace(tmp_path / "a.h5") as a, open_trace(tmp_path / "b.h5") as b:
        assert list(a.index["digest"]) == list(b.index["digest"])
        np.testing.assert_array_equal(_tensor(a, "0#0", "output"), _tensor(b, "0#0", "output"))


def test_include_and_exclude_narrow_the_sites(trace_path):
    capture(tiny_cases.tiny(), trace_path, include=["block*"], exclude=["*.drop"])
    with open_trace(trace_path) as trace:
        sites = set(trace.sites["site"]) - {"<loss>#0"}
        assert sites and all(s.startswith("block") for s in sites)
        assert not any(".drop#" in s for s in sites)


def test_keyword_inputs_of_the_model(trace_path):
    capture(tiny_cases.tiny_kwargs(), trace_path)
    with open_trace(trace_path) as trace:
        assert set(trace.index.query("site == '<root>#0' and role == 'input'")["arg"]) == {
            "x", "mask"}


# ---- bad input: a clear sentence, nothing published ----

def test_model_raising_names_the_site_and_publishes_nothing(trace_path):
    with pytest.raises(CaptureError) as err:
        capture(tiny_cases.exploding(), trace_path)
    message = str(err.value)
    assert "bad#0" in message and "Linear" in message and "no trace was published" in message
    assert not trace_path.exists()
    partial = trace_path.with_name(trace_path.name + ".partial")
    assert partial.exists()
    with open_trace(partial, allow_incomplete=True) as trace:
        assert "first#0" in set(trace.index["site"])  # what ran before the failure is kept


def test_zero_steps_is_refused(trace_path):
    with pytest.raises(CaptureError, match="at least 1"):
        capture(tiny_cases.tiny(), trace_path, steps=0)


def test_many_steps_without_optimizer_is_refused(trace_path):
    with pytest.raises(CaptureError, match="no optimizer"):
        capture(tiny_cases.exploding(), trace_path, steps=2)


def test_include_glob_matching_nothing_is_refused(trace_path):
    with pytest.raises(CaptureError, match="matches no module"):
        capture(tiny_cases.tiny(), trace_path, include=["encoder.*"])


def test_missing_output_directory_is_refused(tmp_path):
    with pytest.raises(CaptureError, match="does not exist"):
        capture(tiny_cases.tiny(), tmp_path / "missing" / "t.h5")


def test_unwritable_output_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("layerdiff.trace.writer.os.access", lambda *a: False)
    with pytest.raises(CaptureError, match="not writable"):
        capture(tiny_cases.tiny(), tmp_path / "t.h5")


def test_writer_failing_mid_run_publishes_nothing(trace_path, monkeypatch):
    calls = {"n": 0}
    original = TraceFile.write_segment

    def full_disk(self, data):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, data)

    monkeypatch.setattr(TraceFile, "write_segment", full_disk)
    with pytest.raises(CaptureError, match="No space left on device"):
        capture(tiny_cases.tiny_steps(), trace_path)
    assert not trace_path.exists()


def test_a_port_that_records_itself(trace_path):
    capture(tiny_cases.numpy_port(), trace_path, loss_scale=4.0)
    with open_trace(trace_path) as trace:
        assert trace.loss_scale == 4.0 and trace.meta["steps"] == 2
        assert sorted(trace.index["step"].unique()) == [0, 1]
        assert set(trace.index["role"]) == {"input", "weight", "output", "grad_output",
                                            "weight_grad"}
        grad = _tensor(trace, "lin#0", "grad_output", step=1)
        np.testing.assert_allclose(grad, np.full((4, 2), 0.5, np.float32))


def test_a_self_recording_port_that_raises_publishes_nothing(trace_path):
    with pytest.raises(CaptureError, match="overflow in lin"):
        capture(tiny_cases.failing_numpy_port(), trace_path)
    assert not trace_path.exists()


def test_include_does_not_apply_to_a_self_recording_port(trace_path):
    with pytest.raises(CaptureError, match="records itself"):
        capture(tiny_cases.numpy_port(), trace_path, include=["lin"])


class _PassThrough(torch.nn.Module):
    """Returns its input as well as a function of it: return x, lin(x)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x, self.lin(x)


def test_an_input_returned_unchanged_gets_one_grad_input_record(trace_path):
    from layerdiff import Case, seed_everything

    seed_everything(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _PassThrough())
    x = torch.randn(3, 4)

    def loss_fn(out):
        a, b = out
        return (3 * a).sum() + (b ** 2).sum()

    capture(Case(model=model, inputs=(x,), loss_fn=loss_fn), trace_path)
    pre = model[0](x)
    pre.retain_grad()
    a, b = model[1](pre)
    loss_fn((a, b)).backward()
    with open_trace(trace_path) as trace:
        rows = trace.index.query("site == '1#0' and role == 'grad_input'")
        assert len(rows) == 1
        np.testing.assert_allclose(trace.read(rows.iloc[0]), pre.grad.numpy(), rtol=1e-6)


def test_the_capture_bar_moves_within_a_step(monkeypatch):
    """The bar reads the records and bytes recorded so far each time it is drawn, so it moves
    during a long step, not once per step."""
    import io
    import time

    from rich.console import Console

    import layerdiff.progress as progress

    screen = Console(file=io.StringIO(), force_terminal=True, width=100)
    monkeypatch.setattr(progress, "Console", lambda stderr=True: screen)
    recorded = [0]
    with progress.StepProgress(1, enabled=True, label="capture my_cases:port",
                               recorded=lambda: (recorded[0], recorded[0] << 20)):
        for _ in range(4):  # one step, never advanced: only the live column can move
            recorded[0] += 7
            time.sleep(0.15)
    drawn = screen.file.getvalue()
    assert "capture my_cases:port" in drawn
    assert "7 records, 7 MiB" in drawn and "28 records, 28 MiB" in drawn


def test_a_spec_captures_as_the_case_it_names(tmp_path):
    """capture() takes 'module:function' as the command line does: the same records, bit for
    bit, as the Case that spec loads."""
    from layerdiff import load_case

    by_spec = capture("reference_models.mlp:reference", tmp_path / "spec.h5")
    by_case = capture(load_case("reference_models.mlp:reference"), tmp_path / "case.h5")
    with open_trace(by_spec) as a, open_trace(by_case) as b:
        assert len(a.index) > 0
        assert a.index["digest"].tolist() == b.index["digest"].tolist()
