"""nan, determinism and batch-independence name the site whose own code made their first bad
record, by the diff's origin rule (a parent when the record is what its code between its
children handed a child; the site itself when it is its own result), in text and JSON."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from layerdiff import Case, capture, open_trace, seed_everything
from layerdiff.debug.determinism import compare_runs
from layerdiff.report.findings import render

CASES = "reference_models.origin_cases"
BETWEEN = "the fault is in its own code between its children"
BACKWARD_BETWEEN = "the fault is in its own backward code between its children"


def _report(run, tmp_path, *args):
    """The JSON report and the text of one run of a command that finds something."""
    result = run(*args, "--json", tmp_path / "report.json")
    assert result.exit_code == 1, result.output
    return json.loads((tmp_path / "report.json").read_text(encoding="utf-8")), result


def _origin(report) -> tuple:
    origin = report["origin"]
    return origin["site"], origin["pass"], origin["step"], origin["role"], origin["arg"]


# ---- nan

def test_nan_made_by_a_parents_code_between_children_names_the_parent(run, tmp_path):
    report, text = _report(run, tmp_path, "nan", f"{CASES}:nan_between")
    assert (report["first"]["site"], report["first"]["role"]) == ("block.out#0", "input")
    assert _origin(report) == ("block#0", "forward", 0, "output", "0")
    assert report["origin"]["holders"] == ["<root>#0"]
    assert "its output is non-finite while all its inputs and weights are finite" in (
        report["origin"]["reason"]) and BETWEEN in report["origin"]["reason"]
    assert "origin: block#0, forward output, step 0: its output is non-finite" in text.output


def test_nan_gradient_made_by_a_parents_backward_code_names_the_parent(run, tmp_path):
    # block#0's input needs no gradient: it records no grad_input, and what its backward code
    # made shows only in the gradient it sends back to block.fc
    report, text = _report(run, tmp_path, "nan", f"{CASES}:nan_between_backward")
    assert (report["first"]["site"], report["first"]["role"]) == ("block.fc#0", "grad_output")
    assert _origin(report)[:2] == ("block#0", "backward")
    assert "sends back to block.fc#0 is non-finite" in report["origin"]["reason"]
    assert BACKWARD_BETWEEN in report["origin"]["reason"]
    assert "origin: block#0, backward" in text.output


def test_nan_made_by_a_leaf_names_the_leaf(run, tmp_path):
    report, text = _report(run, tmp_path, "nan", f"{CASES}:nan_leaf")
    assert _origin(report) == ("block.leaf#0", "forward", 0, "output", "0")
    assert report["origin"]["holders"] == ["<root>#0", "block#0"]
    assert "between its children" not in report["origin"]["reason"]
    assert "origin: block.leaf#0, forward output, step 0" in text.output


def test_nan_in_a_backward_leaf_and_in_the_optimizer_are_named_there():
    from layerdiff.debug.nan import find_nan
    from tests.test_nan import schedule_bug

    result = find_nan("reference_models.numerics:nan_sqrt_backward")
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role) == ("features.sqrt#0", "backward",
                                                        "grad_input")
    result = find_nan(schedule_bug())  # its weights turn NaN in the optimizer step of step 3
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role, origin.step) == ("fc1#0", "optimizer",
                                                                     "weight", 3)
    assert origin.reason == result.producer.why and "(lr inf)" in origin.reason


def test_nan_in_the_case_inputs_has_no_origin():
    from layerdiff.debug.nan import find_nan

    seed_everything(0)
    x = torch.randn(4, 3)
    x[1, 2] = float("nan")
    result = find_nan(Case(model=nn.Linear(3, 1), inputs=(x,), loss_fn=lambda out: out.sum(),
                           name="nan input"))
    assert result.first.site == "<root>#0" and result.first.role == "input"
    assert result.origin is None and result.as_json()["origin"] is None
    assert "origin: none: no site's result is non-finite" in render(result)


# ---- batch-independence

def test_batch_mean_in_a_parents_code_between_children_names_the_parent(run, tmp_path):
    report, text = _report(run, tmp_path, "batch-independence", f"{CASES}:mean_between")
    assert _origin(report) == ("block#0", "forward", 0, "output", "0")
    assert report["origin"]["holders"] == ["<root>#0"]
    assert "its output is mixed across samples" in report["origin"]["reason"]
    assert BETWEEN in report["origin"]["reason"]
    assert "origin: block#0, forward output, step 0: its output is mixed across samples" in (
        text.output)


def test_batch_mean_in_a_leaf_names_the_leaf(run, tmp_path):
    report, text = _report(run, tmp_path, "batch-independence", f"{CASES}:mean_leaf")
    assert _origin(report) == ("block.leaf#0", "forward", 0, "output", "0")
    assert "between its children" not in report["origin"]["reason"]
    assert "origin: block.leaf#0, forward output" in text.output


def test_batch_mixing_only_in_a_backward_is_a_backward_origin():
    from layerdiff.debug import batch_independence
    from reference_models import cnn_port

    # forward right, backward applies sample 0's ReLU mask to every sample
    # (the batch norm inside its block mixes in its forward by design: the block is not named)
    result = batch_independence(cnn_port.bug_relu_backward_batch(), allow=["*bn*"])
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role) == ("block.act#0", "backward",
                                                        "grad_input")
    assert "its grad_input is mixed across samples" in origin.reason


def test_a_clean_case_has_no_origin(run):
    for command in ("nan", "batch-independence"):
        result = run(command, "reference_models.mlp:reference", "--json", "-")
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["origin"] is None


# ---- determinism: runs in one process whose head order is drawn from os.urandom

class _UrandomHeadOrder(nn.Module):
    """Concatenates heads in an order drawn from os.urandom, in its own code, then projects."""

    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.concat = _UrandomConcat() if leaf else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.view(*x.shape[:-1], 8, 2)
        merged = self.concat(heads) if self.concat is not None else _urandom_concat(heads)
        return self.proj(merged)


class _UrandomConcat(nn.Module):
    def forward(self, heads: torch.Tensor) -> torch.Tensor:
        return _urandom_concat(heads)


def _urandom_concat(heads: torch.Tensor) -> torch.Tensor:
    order = sorted(range(heads.shape[-2]), key=lambda _: os.urandom(8))
    return torch.cat([heads[..., h, :] for h in order], dim=-1)


class _Net(nn.Module):
    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.fc, self.mix = nn.Linear(16, 16), _UrandomHeadOrder(leaf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.fc(x)).sum(-1)


@pytest.mark.parametrize("leaf, site, between", [(False, "mix#0", True),
                                                 (True, "mix.concat#0", False)])
def test_determinism_origin_of_an_order_drawn_per_run(tmp_path, leaf, site, between):
    traces = []
    for run in range(2):
        seed_everything(0)
        model = _Net(leaf)
        case = Case(model=model, inputs=(torch.randn(2, 16),),
                    loss_fn=lambda out: out.pow(2).mean(), name="order")
        traces.append(open_trace(capture(case, tmp_path / f"run{run}.h5")))
    try:
        comparison = compare_runs(traces[0], traces[1], 2)
    finally:
        for trace in traces:
            trace.close()
    assert comparison.first.site == ("mix.proj#0" if not leaf else "mix.concat#0")
    origin = comparison.origin
    assert (origin.site, origin.pass_, origin.role) == (site, "forward", "output")
    assert (BETWEEN in origin.reason) is between
    assert comparison.as_json()["origin"]["site"] == site


@pytest.mark.slow  # three fresh Pythons that import torch
def test_determinism_names_the_block_whose_set_order_differs_between_processes(
        run, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # each process salts its own hashes
    report, text = _report(run, tmp_path, "determinism", f"{CASES}:set_order_mix",
                           "--runs", "3", "--parallel")
    assert (report["first"]["site"], report["first"]["role"]) == ("blocks.0.mix.proj#0",
                                                                  "input")
    assert _origin(report) == ("blocks.0.mix#0", "forward", 0, "output", "0")
    assert "its output is different between runs" in report["origin"]["reason"]
    assert BETWEEN in report["origin"]["reason"]
    assert all(c["origin"]["site"] == "blocks.0.mix#0" for c in report["comparisons"])
    assert "origin: blocks.0.mix#0, forward output, step 0" in text.output
    assert all(len(line) <= 100 for line in text.output.splitlines())


@pytest.mark.slow
def test_determinism_names_the_leaf_whose_set_order_differs(run, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    report, text = _report(run, tmp_path, "determinism", f"{CASES}:set_order_leaf",
                           "--parallel")
    assert _origin(report) == ("blocks.0.mix.concat#0", "forward", 0, "output", "0")
    assert "between its children" not in report["origin"]["reason"]
    assert "origin: blocks.0.mix.concat#0, forward output" in text.output


class _UrandomCallOrder(nn.Module):
    """Calls its head modules in an order drawn from os.urandom and concatenates in that order:
    the runs record the heads in other places (a layout difference), each head the same."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(16, 2) for _ in range(8)])
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = sorted(range(len(self.heads)), key=lambda _: os.urandom(8))
        return self.proj(torch.cat([self.heads[h](x) for h in order], dim=-1))


def test_determinism_origin_when_the_runs_call_sites_in_another_order(tmp_path):
    traces = []
    for run in range(2):
        seed_everything(0)
        case = Case(model=_UrandomCallOrder(), inputs=(torch.randn(2, 16),),
                    loss_fn=lambda out: out.pow(2).mean(), name="call order")
        traces.append(open_trace(capture(case, tmp_path / f"run{run}.h5")))
    try:
        comparison = compare_runs(traces[0], traces[1], 2)
    finally:
        for trace in traces:
            trace.close()
    assert comparison.how == "layout"
    # records are matched by name, not place: every head agrees, the concatenation does not
    origin = comparison.origin
    assert (origin.site, origin.pass_, origin.role) == ("<root>#0", "forward", "output")
    assert BETWEEN in origin.reason


# ---- the rule is the diff's: a container with no grad_input, named by what its backward
# ---- code sends back to a child, in a diff of two traces too

class _DoubleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class _Block(nn.Module):
    def __init__(self, wrong: bool) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 1)
        self.wrong = wrong

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))  # its own code, between its children
        return self.out(_DoubleBackward.apply(h) if self.wrong else h)


class _BlockNet(nn.Module):
    def __init__(self, wrong: bool) -> None:
        super().__init__()
        self.block = _Block(wrong)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).squeeze(-1)


def test_diff_names_a_container_whose_backward_code_is_wrong_when_it_has_no_grad_input(
        tmp_path):
    from layerdiff import diff

    paths = []
    for wrong in (False, True):
        seed_everything(0)
        case = Case(model=_BlockNet(wrong), inputs=(torch.randn(6, 4),),
                    loss_fn=lambda out: out.pow(2).mean(), name="block")
        paths.append(capture(case, tmp_path / f"{wrong}.h5"))
    result = diff(*paths)
    origin = result.origins[0]
    assert (origin.site, origin.pass_) == ("block#0", "backward")
    assert "sends back to block.fc#0 is out of tolerance" in origin.reason
