"""The one module walk and hook list (capture/modules.py), and the one RNG helper (rng.py):
every hook a part puts on a model comes off again, however the run ended, and a diagnostic
leaves the caller's random state as it found it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, capture, rng
from layerdiff.capture.modules import (
    ModuleHooks,
    get_module,
    hook_every_call,
    is_leaf,
    module_paths,
    named_modules,
)
from layerdiff.debug.batch import batch_independence
from layerdiff.errors import CaptureError
from layerdiff.trace import schema


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner.forward(x))   # a direct call, as llama2.c makes


class Model(nn.Module):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()
        self.again = self.first                # one module under two names: walked once
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.second(self.first(x))
        if self.fail:
            raise RuntimeError("planted failure after the blocks ran")
        return x


def _hooks_left(model: nn.Module) -> list[str]:
    """Every module that still holds a hook or a forward wrapper."""
    return [path for path, module in named_modules(model)
            if module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
            or "forward" in module.__dict__]


def test_the_walk_names_the_root_and_visits_each_module_once() -> None:
    model = Model()
    assert module_paths(model) == [schema.ROOT_MODULE, "first", "first.inner", "first.act",
                                   "second", "second.inner", "second.act"]
    assert get_module(model, schema.ROOT_MODULE) is model
    assert get_module(model, "second.inner") is model.second.inner
    leaves = [path for path, module in named_modules(model) if is_leaf(module)]
    assert leaves == ["first.inner", "first.act", "second.inner", "second.act"]


def test_every_call_is_seen_with_its_path_and_every_hook_comes_off() -> None:
    model = Model()
    calls: list[tuple[str, str]] = []
    with hook_every_call(model, lambda path, *_: calls.append(("enter", path)),
                         lambda path, *_: calls.append(("exit", path)),
                         direct_calls=True) as hooks:
        assert len(hooks) == 2 * len(module_paths(model))
        model(torch.ones(2, 4))
    assert calls[:4] == [("enter", schema.ROOT_MODULE), ("enter", "first"),
                         ("enter", "first.inner"), ("exit", "first.inner")]
    assert ("enter", "second.inner") in calls        # seen although called as .forward(...)
    assert _hooks_left(model) == []
    model(torch.ones(2, 4))                          # and nothing runs any more
    assert len(calls) == 14


def test_without_direct_calls_a_direct_forward_call_is_not_seen() -> None:
    model = Model()
    seen: list[str] = []
    with hook_every_call(model, lambda path, *_: seen.append(path), lambda *_: None):
        model(torch.ones(2, 4))
    assert "first.inner" not in seen and "first.act" in seen
    assert _hooks_left(model) == []


def test_hooks_come_off_when_the_run_raises() -> None:
    model = Model(fail=True)
    with (pytest.raises(RuntimeError, match="planted"),
          hook_every_call(model, lambda *_: None, lambda *_: None, direct_calls=True)):
        model(torch.ones(2, 4))
    assert _hooks_left(model) == []


def test_a_handle_added_by_hand_comes_off_with_the_rest() -> None:
    model = Model()
    hooks = ModuleHooks()
    hooks.add(model.first.register_full_backward_hook(lambda *_: None))
    hooks.after(model.second, lambda *_: None, always_call=True)
    assert _hooks_left(model) == ["first", "second"]
    hooks.remove()
    hooks.remove()   # twice is harmless
    assert _hooks_left(model) == [] and len(hooks) == 0


def test_a_capture_whose_model_raises_leaves_no_hook(tmp_path) -> None:
    model = Model(fail=True)
    case = Case(model, (torch.ones(2, 4),), lambda out: out.sum(), name="fails")
    with pytest.raises(CaptureError, match="planted"):
        capture(case, tmp_path / "t.h5", ops=["*"])
    assert _hooks_left(model) == []


def test_batch_independence_whose_model_raises_leaves_no_hook() -> None:
    model = Model(fail=True)
    case = Case(model, (torch.ones(3, 4),), lambda out: out.sum(), name="fails")
    with pytest.raises(CaptureError, match="planted"):
        batch_independence(case)
    assert _hooks_left(model) == []


# ---- the random state


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_preserved_restores_every_generator_also_when_the_block_raises() -> None:
    rng.seed_everything(5)
    with rng.preserved():
        rng.seed_everything(123)
        _draws()
    after_block = _draws()
    rng.seed_everything(5)
    assert _draws() == after_block
    rng.seed_everything(5)
    with pytest.raises(KeyError), rng.preserved():
        _draws()
        raise KeyError("inside")
    assert _draws() == after_block


def test_seeded_draws_the_same_every_time_and_leaves_the_caller_alone() -> None:
    rng.seed_everything(7)
    expected = _draws()
    rng.seed_everything(7)
    with rng.seeded(99):
        first = torch.rand(3)
    with rng.seeded(99):
        second = torch.rand(3)
    assert torch.equal(first, second)
    assert _draws() == expected      # python, numpy and torch as if the blocks never ran


def test_a_saved_state_restores_later() -> None:
    rng.seed_everything(3)
    state = rng.save()
    expected = _draws()
    _draws()
    state.restore()
    assert _draws() == expected


def test_seeding_named_devices_queues_nothing_for_cuda() -> None:
    """``torch.manual_seed`` queues a lazy seeding of every CUDA device (with a stack trace)
    on a machine where CUDA is not initialised; seeding the CPU and named devices does not."""
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised: nothing is queued either way")
    tracker = torch.cuda._lazy_seed_tracker
    before = tracker.get_calls()
    rng.seed_torch(11)
    with rng.seeded(12):
        pass
    assert tracker.get_calls() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generators_are_restored() -> None:
    torch.cuda.init()
    before = torch.cuda.get_rng_state(0)
    with rng.preserved([0]):
        torch.cuda.manual_seed(1234)
        torch.rand(4, device="cuda")
    assert torch.equal(torch.cuda.get_rng_state(0), before)
    with rng.seeded(5, [0]):
        first = torch.rand(4, device="cuda")
    with rng.seeded(5, [0]):
        second = torch.rand(4, device="cuda")
    assert torch.equal(first, second)
    assert torch.equal(torch.cuda.get_rng_state(0), before)
