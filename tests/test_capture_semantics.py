"""Capture records what users mean: grad_output is the gradient arriving at an output from
outside the call (what torch's full backward hooks report), and a module called through
``.forward()`` is a site like any other."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture, open_trace, run_case, seed_everything


class WeightsAttention(nn.Module):
    """Like Hugging Face's eager attention: returns (output, weights) and used the weights
    itself (weights @ v)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.proj(weights @ v), weights


class Block(nn.Module):
    def __init__(self, width: int = 8, use_weights: float = 0.0) -> None:
        super().__init__()
        self.attn = WeightsAttention(width)
        self.use_weights = use_weights   # 0: the block throws the weights away

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attn(x)
        if self.use_weights:
            out = out + self.use_weights * weights.sum(-1, keepdim=True)
        return x + out


class Net(nn.Module):
    def __init__(self, use_weights: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.block = Block(use_weights=use_weights)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _case(use_weights: float = 0.0, seed: int = 0, steps: int = 1) -> Case:
    seed_everything(seed)
    model = Net(use_weights)
    x = torch.randn(2, 5, 4)
    target = torch.randn(2, 5, 3)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.mse_loss(out, target),
                seed=seed, steps=steps, name="semantics",
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def _records(trace, site: str, role: str) -> dict[str, np.ndarray]:
    rows = trace.index[(trace.index["site"] == site) & (trace.index["role"] == role)
                       & (trace.index["step"] == 0)]
    return {row["arg"]: trace.read(row) for _, row in rows.iterrows()}


def _full_hook_grads(case: Case, module_path: str) -> tuple[tuple, tuple]:
    """(grad_input, grad_output) that torch's register_full_backward_hook reports."""
    seen = {}
    module = case.model.get_submodule(module_path)
    module.register_full_backward_hook(
        lambda m, grad_in, grad_out: seen.update(grad_in=grad_in, grad_out=grad_out))
    case.loss_fn(case.call_model()).backward()
    return seen["grad_in"], seen["grad_out"]


def test_an_output_the_module_used_and_nobody_else_has_no_grad_output(tmp_path):
    capture(_case(), tmp_path / "t.h5")
    _, expected = _full_hook_grads(_case(), "block.attn")
    assert expected[1] is None   # torch's hook: nothing arrives at the weights from outside
    with open_trace(tmp_path / "t.h5") as trace:
        assert trace.meta["grad_output"] == "outside"   # replay reads the definition here
        grad_output = _records(trace, "block.attn#0", "grad_output")
        assert set(grad_output) == {"0"}, "the weights' internal use was recorded as arriving"
        np.testing.assert_allclose(grad_output["0"], expected[0].numpy(), rtol=1e-6,
                                   atol=1e-9)


def test_an_output_used_inside_and_outside_carries_only_the_outside_gradient(tmp_path):
    capture(_case(use_weights=0.5), tmp_path / "t.h5")
    grad_in, expected = _full_hook_grads(_case(use_weights=0.5), "block.attn")
    with open_trace(tmp_path / "t.h5") as trace:
        grad_output = _records(trace, "block.attn#0", "grad_output")
        assert set(grad_output) == {"0", "1"}
        np.testing.assert_allclose(grad_output["0"], expected[0].numpy(), rtol=1e-6,
                                   atol=1e-9)
        np.testing.assert_allclose(grad_output["1"], expected[1].numpy(), rtol=1e-6,
                                   atol=1e-9)
        # the caller's gradient alone (of w.sum(-1): the same along a row), not that plus the
        # gradient of weights @ v
        np.testing.assert_array_equal(grad_output["1"], np.broadcast_to(
            grad_output["1"][..., :1], grad_output["1"].shape))
        # what the call sends back to its input is unchanged by the definition
        np.testing.assert_allclose(_records(trace, "block.attn#0", "grad_input")["0"],
                                   grad_in[0].numpy(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("use_weights", [0.0, 0.5])
def test_capture_changes_no_number(tmp_path, use_weights):
    plain = _case(use_weights, steps=3)
    result = run_case(plain)
    captured = _case(use_weights, steps=3)
    capture(captured, tmp_path / "t.h5")
    again = run_case(_case(use_weights, steps=3))
    assert [float(x) for x in result.losses] == [float(x) for x in again.losses]
    for (name, a), b in zip(plain.model.named_parameters(), captured.model.parameters(),
                            strict=True):
        assert torch.equal(a, b), name
        assert torch.equal(a.grad, b.grad), name


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _ReturnsChild(nn.Module):
    """Returns its child's output, and uses it itself too (a norm of it, returned apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inner(x)
        return h, (h * h).sum(-1)


def test_a_parent_returning_its_childs_output(tmp_path):
    """The parent's grad_output is what arrives from outside the parent; the child's is what
    arrives at the child's output: from the parent's code and beyond."""
    seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 8), _ReturnsChild())
    x = torch.randn(3, 4)

    def loss_fn(out):
        h, norms = out
        return (h * torch.arange(8.0)).sum() + norms.sum() * 0.25

    capture(Case(model=model, inputs=(x,), loss_fn=loss_fn), tmp_path / "t.h5")
    h = model[1].inner(model[0](x)).detach().requires_grad_()
    (outside,) = torch.autograd.grad((h * torch.arange(8.0)).sum(), h)
    (norms,) = torch.autograd.grad(((h * h).sum(-1)).sum() * 0.25, h)
    with open_trace(tmp_path / "t.h5") as trace:
        parent = _records(trace, "1#0", "grad_output")
        child = _records(trace, "1.inner#0", "grad_output")
        np.testing.assert_allclose(parent["0"], outside.numpy(), rtol=1e-6)
        np.testing.assert_allclose(parent["1"], np.full((3,), 0.25), rtol=1e-6)
        np.testing.assert_allclose(child["0"], (outside + norms).numpy(), rtol=1e-6)
        inner_lin = _records(trace, "1.inner.lin#0", "grad_output")
        np.testing.assert_array_equal(inner_lin["0"], child["0"])


class _InPlaceCaller(nn.Module):
    """The caller changes the attention's output in place (an in-place activation) and uses
    the view of another output: capture must not get in the way of either."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = WeightsAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.attn(x)
        out = F.relu(out, inplace=True)
        return out + weights[..., :1]


@pytest.mark.parametrize("shape", [(8, 8), (2, 8, 8)])
def test_in_place_and_views_on_outputs_change_no_number(tmp_path, shape):
    """On 2-D inputs the attention's output is a tensor of its own; on 3-D ones Linear returns
    a view, and the in-place activation rebases its base: numbers unchanged either way."""
    def make():
        seed_everything(1)
        model = _InPlaceCaller()
        x = torch.randn(*shape)
        return Case(model=model, inputs=(x,), loss_fn=lambda out: (out ** 2).mean(),
                    steps=2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))

    plain = make()
    run_case(plain)
    captured = make()
    capture(captured, tmp_path / "t.h5")
    for a, b in zip(plain.model.parameters(), captured.model.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    fresh = make()
    out, weights = fresh.model.attn(*fresh.inputs)
    out = out.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    loss = fresh.loss_fn(F.relu(out) + weights[..., :1])
    expected = torch.autograd.grad(loss, (out, weights))
    with open_trace(tmp_path / "t.h5") as trace:
        grad_output = _records(trace, "attn#0", "grad_output")
        np.testing.assert_allclose(grad_output["0"], expected[0].numpy(), rtol=1e-6)
        # only the caller's slice of the weights: the attention's own use is left out
        np.testing.assert_allclose(grad_output["1"], expected[1].numpy(), rtol=1e-6)
        assert (grad_output["1"][..., 1:] == 0).all()


# ---- modules called through .forward() ----

class _Attention(nn.Module):
    def __init__(self, width: int = 8, bug: bool = False) -> None:
        super().__init__()
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.bug = bug

    def forward(self, x: torch.Tensor, causal: bool = True) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        scale = q.shape[-1] ** (-0.25 if self.bug else -0.5)   # the planted bug
        scores = q @ k.transpose(-1, -2) * scale
        if causal:
            t = x.shape[-2]
            scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        return self.wo(torch.softmax(scores, dim=-1) @ v)


class _FeedForward(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, 2 * width)
        self.w2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class _LlamaBlock(nn.Module):
    """llama2.c's TransformerBlock calls its attention and feed-forward through .forward()."""

    def __init__(self, direct: bool, bug: bool = False) -> None:
        super().__init__()
        self.direct = direct
        self.attention = _Attention(bug=bug)
        self.feed_forward = _FeedForward()
        self.attention_norm = nn.LayerNorm(8)
        self.ffn_norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.direct:
            h = x + self.attention.forward(self.attention_norm(x), causal=True)
            return h + self.feed_forward.forward(self.ffn_norm(h))
        h = x + self.attention(self.attention_norm(x), causal=True)
        return h + self.feed_forward(self.ffn_norm(h))


class _Llama(nn.Module):
    def __init__(self, direct: bool, bug: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.layers = nn.ModuleList([_LlamaBlock(direct, bug), _LlamaBlock(direct)])
        self.head = nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _llama_case(direct: bool, bug: bool = False, steps: int = 1) -> Case:
    seed_everything(0)
    model = _Llama(direct, bug)
    tokens = torch.randint(0, 11, (2, 6))
    target = torch.randint(0, 11, (2, 6))
    return Case(model=model, inputs=(tokens,), steps=steps, seed=0, name="llama",
                loss_fn=lambda out: F.cross_entropy(out.flatten(0, 1), target.flatten()),
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def _keys(trace) -> list[tuple]:
    index = trace.index
    return sorted(zip(index["step"], index["pass"], index["site"], index["role"], index["arg"],
                      index["shape"].astype(str), strict=True))


def test_a_module_called_through_forward_records_what_a_call_records(tmp_path):
    capture(_llama_case(direct=False, steps=2), tmp_path / "call.h5", ops=["layers.0.attention"])
    capture(_llama_case(direct=True, steps=2), tmp_path / "forward.h5",
            ops=["layers.0.attention"])
    with open_trace(tmp_path / "call.h5") as called, open_trace(tmp_path / "forward.h5") as direct:
        assert "layers.0.attention#0" in set(direct.sites["site"])
        assert "layers.1.feed_forward#0" in set(direct.sites["site"])
        assert any(site.startswith("layers.0.attention#0/") for site in direct.sites["site"])
        assert _keys(direct) == _keys(called)   # same records, nothing recorded twice
        columns = ["site", "module", "call", "type", "parent"]
        assert (direct.sites[columns].values.tolist()
                == called.sites[columns].values.tolist())
        for (_, a), (_, b) in zip(called.index.iterrows(), direct.index.iterrows(),
                                  strict=True):
            assert (a["site"], a["role"], a["arg"]) == (b["site"], b["role"], b["arg"])
            if a["kind"] == "tensor":
                np.testing.assert_array_equal(called.read(a), direct.read(b))


def test_capturing_forward_calls_changes_no_number_and_restores_forward(tmp_path):
    plain = _llama_case(direct=True, steps=3)
    run_case(plain)
    captured = _llama_case(direct=True, steps=3)
    own = captured.model.layers[1].feed_forward
    own.forward = own.forward   # an instance forward of the model's own (as accelerate sets)
    before = own.__dict__["forward"]
    capture(captured, tmp_path / "t.h5")
    for a, b in zip(plain.model.parameters(), captured.model.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    assert own.__dict__["forward"] is before
    assert all("forward" not in m.__dict__ for m in captured.model.modules() if m is not own)


def test_a_model_hook_does_not_start_running_on_forward_calls(tmp_path):
    """A hook of the model's own never runs on child.forward(...): capturing must not make it."""
    case = _llama_case(direct=True)
    seen = []
    case.model.layers[0].attention.register_forward_hook(lambda *a: seen.append(1))
    capture(case, tmp_path / "t.h5")
    assert seen == []


def test_a_bug_in_an_attention_called_through_forward_is_named_there(tmp_path):
    from layerdiff import diff

    capture(_llama_case(direct=True), tmp_path / "ref.h5")
    capture(_llama_case(direct=True, bug=True), tmp_path / "port.h5")
    result = diff(tmp_path / "ref.h5", tmp_path / "port.h5")
    assert [origin.site for origin in result.origins] == ["layers.0.attention#0"]


def _llama_port(bug: bool = False):
    return lambda: _llama_case(direct=True, bug=bug, steps=2)


def _llama_reference():
    return _llama_case(direct=False, steps=2)


def test_replay_judges_a_port_layer_called_through_forward(tmp_path):
    from layerdiff.replay import replay

    capture(_llama_reference(), tmp_path / "ref.h5")
    result = replay(tmp_path / "ref.h5", _llama_port(bug=True)())
    assert not result.cannot_judge
    local = result.local
    local = local[local["verdict"] == "LOCAL ERROR"]
    assert "layers.0.attention#0" in set(local["port_site"])
    assert not {s for s in local["port_site"] if not s.startswith("layers.0.attention")}
    assert replay(tmp_path / "ref.h5", _llama_port()()).passed


def test_swap_and_bisect_treat_a_layer_called_through_forward_as_a_layer():
    from layerdiff.replay.bisect import bisect
    from layerdiff.replay.swap import Swapper, swap

    swapper = Swapper(_llama_reference, _llama_port(bug=True))
    assert "layers.0.attention" in swapper.pairs
    assert swap(_llama_reference, _llama_port(bug=True), ["layers.0.attention"]).breaks
    assert not swap(_llama_reference, _llama_port(bug=True), ["layers.1.attention"]).breaks
    # the reference's attention in the port, which calls it through .forward(), fixes it
    assert not swap(_llama_reference, _llama_port(bug=True), ["layers.0.attention"],
                    into="port").breaks
    assert swap(_llama_reference, _llama_port(bug=True), ["layers.1.attention"],
                into="port").breaks
    result = bisect(swapper)
    assert [port for _, port in result.culprits] == ["layers.0.attention"]


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h


def test_a_tensor_returned_twice_carries_what_arrives_at_it_under_each_path(tmp_path):
    """One value under two paths: each path's grad_output is the whole gradient arriving at it
    from outside (2 + 3 here), and the numbers are those of a run without capture."""
    def make():
        seed_everything(0)
        return Case(model=nn.Sequential(_Twice()), inputs=(torch.randn(3, 4),), steps=2,
                    loss_fn=lambda out: (2 * out[0] + 3 * out[1]).sum(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))

    plain, captured = make(), make()
    run_case(plain)
    capture(captured, tmp_path / "t.h5")
    for a, b in zip(plain.model.parameters(), captured.model.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad)
    with open_trace(tmp_path / "t.h5") as trace:
        grad_output = _records(trace, "0#0", "grad_output")
        assert set(grad_output) == {"0", "1"}
        for value in grad_output.values():
            np.testing.assert_array_equal(value, np.full((3, 4), 5.0, np.float32))
        np.testing.assert_array_equal(_records(trace, "0.lin#0", "grad_output")["0"],
                                      np.full((3, 4), 5.0, np.float32))


def test_a_copy_made_while_forward_is_wrapped_runs_its_own_weights():
    import copy

    from layerdiff.capture.direct import DirectCalls

    layer = nn.Linear(3, 3)
    calls = DirectCalls()
    calls.wrap(layer)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.zero_()
    x = torch.ones(1, 3)
    assert torch.equal(twin(x), torch.zeros(1, 3))
    assert torch.equal(twin.forward(x), torch.zeros(1, 3))
    assert not torch.equal(layer(x), torch.zeros(1, 3))
    calls.unwrap()
    assert "forward" not in layer.__dict__


class _NeedsContext(torch.autograd.Function):
    """Identity whose backward, like a loss under torch's loss_parallel(), fails outside the
    context it was computed in."""

    active = False   # set by the context below, as loss_parallel sets its own state

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if not _NeedsContext.active:
            raise RuntimeError("backward outside its context")
        return grad


class _Context:
    def __enter__(self) -> None:
        _NeedsContext.active = True

    def __exit__(self, *exc: object) -> None:
        _NeedsContext.active = False


def test_step_context_holds_the_forward_loss_and_backward(tmp_path):
    seed_everything(0)
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)

    def case(**more) -> Case:
        return Case(model=model, inputs=(x,), steps=2, name="needs_context",
                    loss_fn=lambda out: _NeedsContext.apply(out).square().mean(),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), **more)

    with pytest.raises(RuntimeError, match="backward outside its context"):
        run_case(case())
    path = capture(case(step_context=_Context), tmp_path / "t.h5")
    with open_trace(path) as trace:
        assert set(trace.index["step"]) == {0, 1}
        assert trace.find(1, "<root>#0", "weight_grad", "weight") is not None
    assert not _NeedsContext.active   # left after each step
