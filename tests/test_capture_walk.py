"""grad_input stays a call's own contribution when capture's walk steps over the interiors of
the calls that finished inside it (their frontiers) and hooks each graph node once.

Each case pins a way the shortcut could go wrong: a child with two outputs of which the parent
uses one (the other is kept and used outside the parent: taking the child's whole frontier would
add that path's gradient to the parent's grad_input), a tensor shared by children and the parent
itself, a tensor a call keeps and a later call (or the caller) uses, a wrapper returning its
child's output (two calls, one output node), an in-place change of a child's output. Expected
values come from ``torch.autograd.grad`` of the call's outputs with the gradients that reached
them, in a run without capture; and the records, in order, are the same as the full walk's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, capture, open_trace, seed_everything
from layerdiff.capture.hooks import ModuleRecorder

WIDTH = 6


class Split(nn.Module):
    """Two outputs from the same input, through separate interiors."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), torch.sin(self.b(x))


class Wrap(nn.Module):
    """Returns its child's output as is: two calls share one output node."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = Split()
        self.mix = Wrap()
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, z = self.split(x)
        self.kept = z            # the caller uses it after this call: not this call's gradient
        m = self.mix(y)
        m.add_(x)                # in place on a child's output; x shared with the children
        return torch.tanh(m)


class Memory(nn.Module):
    """Keeps its projection from one call and adds it in the next (a cache across calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.lin(x)
        out = k if self.cache is None else k * self.cache
        self.cache = k
        return torch.relu(out) + 0.1 * out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH)
        self.block = Block()
        self.memory = Memory()
        self.post = Wrap()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.memory.cache = None
        h = self.pre(x)
        b = self.block(h)
        first = self.memory(b)
        second = self.memory(first * 2)
        return self.post(second) + torch.cos(self.block.kept)


def _case() -> Case:
    seed_everything(0)
    model = Net()
    x = torch.randn(4, WIDTH, requires_grad=True)   # the root's grad_input is recorded too
    return Case(model=model, inputs=(x,), loss_fn=lambda out: (out ** 2).sum(), seed=0,
                name="walk", steps=1)


# Calls whose grad_input is the gradient of their outputs alone. Two are left out: mix's output
# is changed in place by its caller (retain_grad then holds the changed value's gradient), and
# memory#0's projection is kept and used by memory#1, so the node that consumes its input also
# carries that later use's gradient (a hook on that node sees their sum, walk or no walk).
CALLS = ["<root>#0", "block#0", "block.split#0", "memory#1", "post#0", "post.inner#0"]


def _expected_grad_inputs() -> dict[str, np.ndarray]:
    """Each call's own contribution to its input's gradient, by autograd, without capture:
    the gradient of the call's outputs with respect to its input, given what reached them."""
    case = _case()
    model = case.model
    calls: dict[str, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
    counts: dict[str, int] = {}
    paths = {module: path or "<root>" for path, module in model.named_modules()}

    def after(module: nn.Module, args: tuple, output) -> None:
        path = paths[module]
        call = counts.get(path, 0)
        counts[path] = call + 1
        outputs = output if isinstance(output, tuple) else (output,)
        for tensor in outputs:
            tensor.retain_grad()
        calls[f"{path}#{call}"] = (args[0], outputs)

    for module in model.modules():
        module.register_forward_hook(after)
    case.loss_fn(case.call_model()).backward(retain_graph=True)
    # what reached each output, taken before autograd.grad runs (its retain_grad hooks may add
    # to .grad again)
    arrived = {site: [(o, o.grad.clone()) for o in outputs if o.grad is not None]
               for site, (_, outputs) in calls.items()}
    expected = {}
    for site in CALLS:
        given = calls[site][0]
        used = arrived[site]
        grads = torch.autograd.grad([o for o, _ in used], given, [g for _, g in used],
                                    retain_graph=True)
        expected[site] = grads[0].numpy()
    return expected


def _recorded(path) -> dict[str, np.ndarray]:
    with open_trace(path) as trace:
        rows = trace.index[(trace.index["role"] == "grad_input") & (trace.index["arg"] == "0")]
        return {row["site"]: trace.read(row) for _, row in rows.iterrows()}


def test_grad_input_is_the_calls_own_contribution_through_shared_and_kept_tensors(tmp_path):
    expected = _expected_grad_inputs()
    recorded = _recorded(capture(_case(), tmp_path / "t.h5"))
    for site, value in expected.items():
        assert site in recorded, f"{site} has no grad_input record"
        np.testing.assert_allclose(recorded[site], value, rtol=1e-5, atol=1e-6,
                                   err_msg=f"grad_input of {site}")
    # the two outputs of one node: the wrapper and its child record the same gradient
    np.testing.assert_array_equal(recorded["post#0"], recorded["post.inner#0"])


def _index(path):
    with open_trace(path) as trace:
        index = trace.index.drop(columns=["segment", "offset"])
        return index, trace.sites


@pytest.mark.parametrize("spec", [None, "reference_models.transformer:reference",
                                  "reference_models.convlstm:reference"])
def test_stepping_over_finished_calls_records_what_the_full_walk_records(
        tmp_path, monkeypatch, spec):
    def run(name: str):
        case = _case() if spec is None else spec
        return _index(capture(case, tmp_path / name, steps=1))

    stepped = run("stepped.h5")
    monkeypatch.setattr(ModuleRecorder, "skip_finished_calls", False)
    walked = run("walked.h5")
    assert stepped[0].astype(str).equals(walked[0].astype(str))
    assert stepped[1].astype(str).equals(walked[1].astype(str))


def test_each_graph_node_gets_one_hook_per_step(monkeypatch, tmp_path):
    """The node consuming a block's input feeds the grad_input of the block and of its child
    (and its outside consumers' records): one hook runs all of their slots, so the backward
    runs no more of our hooks than there are hooked nodes."""
    ran: list[int] = []
    hooked: list[int] = []
    on_gradients = ModuleRecorder._on_gradients
    record_loss = ModuleRecorder.record_loss

    def counting(self, slots, grad_inputs, grad_outputs):
        ran.append(id(slots))
        return on_gradients(self, slots, grad_inputs, grad_outputs)

    def loss_then_count(self, loss):
        record_loss(self, loss)
        hooked.append(len(self._node_slots))

    monkeypatch.setattr(ModuleRecorder, "_on_gradients", counting)
    monkeypatch.setattr(ModuleRecorder, "record_loss", loss_then_count)
    capture(_case(), tmp_path / "t.h5")
    assert ran and len(ran) == len(set(ran)) <= hooked[0]


class ThreeUses(nn.Module):
    """Uses its input three times (q, k, v): its grad_input is a sum of three contributions."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)
        self.v = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        return weights @ self.v(x)


def _three_uses_case() -> Case:
    seed_everything(1)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), ThreeUses(), nn.Linear(WIDTH, 2))
    x = torch.randn(5, WIDTH)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: (out ** 2).sum(), seed=1,
                name="three-uses", steps=3, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_a_sum_of_contributions_is_exact_in_every_step_with_reused_memory(tmp_path):
    """The sums go into memory reused from step to step: each step's record is its own."""
    from layerdiff import run_case

    case = _three_uses_case()
    seen = []
    case.model[1].register_full_backward_hook(
        lambda module, grad_in, grad_out: seen.append(grad_in[0].clone()))
    run_case(case)
    path = capture(_three_uses_case(), tmp_path / "t.h5")
    with open_trace(path) as trace:
        rows = trace.index.query("site == '1#0' and role == 'grad_input'")
        recorded = [trace.read(row) for _, row in rows.sort_values("step").iterrows()]
    assert len(recorded) == len(seen) == 3
    for step, (got, want) in enumerate(zip(recorded, seen, strict=True)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=f"step {step}")
    assert not np.array_equal(recorded[0], recorded[1])   # the weights moved between steps


def test_sum_buffers_add_as_plain_addition_and_lend_memory_back():
    from layerdiff.capture.hooks import _SumBuffers

    sums = _SumBuffers()
    a, b, c = (torch.randn(4, 5) for _ in range(3))
    kept = a.clone(), b.clone()
    total = sums.add(a, b)
    total = sums.add(total, c)
    assert torch.equal(total, (a + b) + c)
    assert torch.equal(a, kept[0]) and torch.equal(b, kept[1])   # autograd's tensors untouched
    address = total.data_ptr()
    sums.give_back(total)
    again = sums.add(c, a)
    assert again.data_ptr() == address and torch.equal(again, c + a)
    # what cannot go in place is added as before: broadcasting, another dtype
    assert torch.equal(sums.add(a, torch.ones(5)), a + 1)
    assert sums.add(a, b.double()).dtype == torch.float64
