"""batch_independence: a site that mixes samples is found where its code does it, in the pass
where it does it; clean models and mixing by design are not findings."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, CaseError, ExternalCase
from layerdiff.debug.batch import MixTest, batch_independence
from layerdiff.report.findings import render
from reference_models import batch_mixing, cnn_port, transformer, transformer_port

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(model: nn.Module, *inputs, name: str) -> Case:
    return Case(model=model, inputs=inputs, loss_fn=lambda out: out.float().pow(2).mean(),
                name=name)


def _check_output(result) -> None:
    json.dumps(result.as_json(), allow_nan=False)
    assert all(len(line) <= 100 for line in render(result).splitlines())


# ---- the bundled case: batch-first to sequence-first with reshape


def test_reshape_to_sequence_first_is_found_in_the_attention_wrapper():
    result = batch_independence(batch_mixing.bug_reshape_seq_first())
    assert result.found
    assert result.first.site == "blocks.0.attn#0"
    assert result.first.pass_ == "forward"
    assert {e.test for e in result.first.evidence} == {MixTest.PERTURBATION, MixTest.GRADIENT}
    leaves = [m.site for m in result.mixing if not m.holds]
    assert leaves == ["blocks.0.attn#0", "blocks.1.attn#0"]
    # the MultiheadAttention inside gets sequence-first input and mixes nothing itself
    sites = {m.site for m in result.mixing}
    assert "blocks.0.attn.mha#0" not in sites
    assert {"blocks.0#0", "<root>#0"} <= sites
    assert next(m for m in result.mixing if m.site == "blocks.0#0").holds == ["blocks.0.attn#0"]
    _check_output(result)


def test_transpose_to_sequence_first_mixes_nothing():
    result = batch_independence(batch_mixing.reference())
    assert not result.found and result.first is None
    assert result.allowed == [] and result.untested == {}
    assert result.tested == {"gradient": 21, "perturbation": 21, "backward perturbation": 21}
    _check_output(result)


SMALL = transformer.Config(d_model=16, heads=2, d_ff=32, layers=1, batch=3, src_len=5,
                           tgt_len=4)


def test_clean_transformer_mixes_nothing():
    case = transformer.build(SMALL, name="small transformer")
    result = batch_independence(case)
    assert not result.found
    assert result.tested["perturbation"] == result.sites  # token inputs are varied too


def test_head_split_reshape_in_the_transformer_port_is_found_at_the_first_attention():
    reference = transformer.build(SMALL, name="small transformer")
    options = transformer_port.PortOptions(split=transformer_port.reshape_split)
    with torch.no_grad():
        model = transformer_port.from_reference(
            transformer_port.TransformerPort(SMALL, options), reference.model)
    case = Case(model=model, inputs=reference.inputs, loss_fn=reference.loss_fn,
                name="small port, head split by reshape")
    result = batch_independence(case)
    assert result.first.site == "enc.0.self_attn#0"
    assert result.first.pass_ == "forward"


# ---- mixing by design


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 7)
        self.bn = nn.BatchNorm1d(7)
        self.out = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.bn(self.fc(x))))


def test_batch_norm_in_training_is_allowed_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = NormNet()
    case = _case(model, torch.randn(5, 4), name="norm net")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    result = batch_independence(case)
    assert not result.found
    assert [m.site for m in result.allowed] == ["<root>#0", "bn#0"]
    assert "batch norm" in result.allowed[1].allowed
    assert "bn#0" in result.allowed[0].allowed  # the container holds only allowed mixing
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    _check_output(result)


def test_batch_norm_in_eval_mode_mixes_nothing():
    torch.manual_seed(0)
    model = NormNet().eval()
    result = batch_independence(_case(model, torch.randn(5, 4), name="norm net, eval"))
    assert not result.found and result.allowed == []


def test_allow_globs_make_findings_allowed():
    result = batch_independence(batch_mixing.bug_reshape_seq_first(), allow=["blocks.*.attn"])
    assert not result.found
    allowed = {m.site: m.allowed for m in result.allowed}
    assert allowed["blocks.0.attn#0"] == "allowed by 'blocks.*.attn'"
    assert allowed["<root>#0"].startswith("holds only mixing by design")


# ---- the backward pass


def test_hand_written_backward_that_reads_another_sample_is_found_in_the_backward():
    # forward right, backward applies sample 0's ReLU mask to every sample: only the backward
    # perturbation can see it (the dependence is through a mask, not a gradient)
    result = batch_independence(cnn_port.bug_relu_backward_batch(), allow=["*bn*"])
    assert result.first.site == "block.act#0"
    assert result.first.pass_ == "backward"
    assert [e.test for e in result.first.evidence] == [MixTest.BACKWARD]
    assert 0 in result.first.evidence[0].varied


class SumOverBatchBackward(torch.autograd.Function):
    """Identity forward; a backward that gives every sample the batch's summed gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.sum(0, keepdim=True).expand_as(grad)


class GradSum(nn.Module):
    def forward(self, x):
        return SumOverBatchBackward.apply(x)


def test_backward_that_sums_over_the_batch_is_found_by_the_gradient_test():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), GradSum(), nn.Tanh(), nn.Linear(6, 2))
    result = batch_independence(_case(model, torch.randn(5, 4), name="grad sum"))
    assert [m.site for m in result.mixing if not m.holds] == ["1#0"]
    assert result.first.pass_ == "backward"  # its forward values are independent
    assert MixTest.GRADIENT in {e.test for e in result.first.evidence}


# ---- models of our own: a normalization over the wrong axis, a mask from the wrong sample,
# ---- sequence-first recurrent layers


class WrongAxisNorm(nn.Module):
    """Hand-written layer norm that centres over the batch axis."""

    def forward(self, x):
        centred = x - x.mean(dim=0, keepdim=True)  # BUG: dim=-1
        return centred / (centred.pow(2).mean(dim=-1, keepdim=True) + 1e-5).sqrt()


def test_normalization_over_the_batch_axis_is_found():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), WrongAxisNorm(), nn.Linear(6, 2))
    result = batch_independence(_case(model, torch.randn(5, 4), name="wrong axis norm"))
    assert result.first.site == "2#0" and result.first.pass_ == "forward"


class MaskedMean(nn.Module):
    """Mean over the valid positions; the bug takes the first sample's mask for all."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, x, mask):
        mask = mask[:1].expand_as(mask) if self.bug else mask
        weights = mask.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(1) / weights.sum(1)


class Pooler(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 8)
        self.pool = MaskedMean(bug)
        self.head = nn.Linear(8, 2)

    def forward(self, x, lengths):
        mask = torch.arange(x.size(1)) < lengths.unsqueeze(1)
        return self.head(self.pool(self.proj(x), mask))


@pytest.mark.parametrize("bug", [False, True])
def test_mask_taken_from_another_sample_is_found_by_perturbation(bug):
    torch.manual_seed(0)
    inputs = (torch.randn(5, 7, 3), torch.tensor([7, 3, 5, 2, 6]))
    result = batch_independence(_case(Pooler(bug), *inputs, name="pooler"))
    if not bug:
        assert not result.found
        return
    assert result.first.site == "pool#0"
    # no gradient reaches a boolean mask: only the perturbation sees it
    assert [e.test for e in result.first.evidence] == [MixTest.PERTURBATION]


class Recurrent(nn.Module):
    """Batch-first data through a sequence-first LSTM; ``reshape`` where transpose belonged."""

    def __init__(self, reshape: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, 8)  # (length, batch, features)
        self.head = nn.Linear(8, 2)
        self.reshape = reshape

    def forward(self, x):
        batch, length, features = x.shape
        seq = x.reshape(length, batch, features) if self.reshape else x.transpose(0, 1)
        _, (h, _) = self.rnn(seq)
        return self.head(h[-1])


@pytest.mark.parametrize("reshape", [False, True])
def test_sequence_first_recurrent_layer(reshape):
    torch.manual_seed(0)
    result = batch_independence(_case(Recurrent(reshape), torch.randn(5, 6, 3), name="rnn"))
    assert result.untested == {}  # the LSTM's (length, batch, ...) tensors: axis 1 found
    if reshape:
        assert result.first.site == "<root>#0"  # the root's own code, around a clean LSTM
        assert result.first.holds == []
    else:
        assert not result.found


# ---- bad input


def test_a_batch_of_one_is_refused_with_a_sentence():
    with pytest.raises(CaseError, match="at least 2"):
        batch_independence(_case(nn.Linear(3, 2), torch.randn(1, 3), name="one"))


def test_a_case_without_a_batch_axis_is_refused():
    with pytest.raises(CaseError, match="--batch-axis"):
        batch_independence(_case(nn.Linear(3, 2), torch.randn(4, 3), name="lin"), batch_axis=2)


def test_a_port_that_records_itself_is_refused():
    with pytest.raises(CaseError, match="records itself"):
        batch_independence(ExternalCase(run=lambda *a, **k: None, name="numpy port"))
