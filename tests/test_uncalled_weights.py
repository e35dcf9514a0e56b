"""Parameters of modules that are never called: recorded at the nearest called ancestor.

``torch.nn.MultiheadAttention`` hands ``out_proj.weight`` and ``out_proj.bias`` to
``F.multi_head_attention_forward`` without calling ``out_proj``, so ``out_proj`` has no site of
its own. Its tensors are recorded at the attention's site under their relative names
(``blocks.0.attn.mha#0``, ``out_proj.weight``): the full name the diff, ``load_weights`` and
mappings use is unchanged, so a reference with attention can give its weights to a port.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture, diff, load_weights, open_trace, run_case
from layerdiff.trace.schema import param_name
from reference_models import batch_mixing

PARAM_ROLES = ("weight", "weight_grad")


def _param_rows(trace, step: int | None = None):
    index = trace.index
    rows = index[index["role"].isin(PARAM_ROLES)]
    if step is not None:
        rows = rows[rows["step"] == step]
    names = [param_name(s, a) for s, a in zip(rows["site"], rows["arg"], strict=True)]
    return rows.assign(name=names)


def _read(trace, rows, name: str, role: str, step: int) -> torch.Tensor:
    row = rows[(rows["name"] == name) & (rows["role"] == role) & (rows["step"] == step)]
    assert len(row) == 1, (name, role, step, len(row))
    return torch.from_numpy(trace.read(row.iloc[0]))


def _assert_every_tensor_once_per_step(trace, model: nn.Module, steps: int) -> None:
    """Each parameter: one weight and one weight_grad per step; each buffer: one weight."""
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    buffers = [n for n, _ in model.named_buffers()]
    for step in range(steps):
        rows = _param_rows(trace, step)
        weights = sorted(rows.loc[rows["role"] == "weight", "name"])
        grads = sorted(rows.loc[rows["role"] == "weight_grad", "name"])
        assert weights == sorted(params + buffers), step
        assert grads == sorted(params), step


@pytest.fixture(scope="module")
def mha_trace(tmp_path_factory) -> Path:
    """The attention classifier (two blocks of nn.MultiheadAttention), two Adam steps."""
    return capture(batch_mixing.reference(), tmp_path_factory.mktemp("mha") / "ref.h5",
                   steps=2)


def test_out_proj_is_recorded_once_per_step_at_the_attention_that_uses_it(mha_trace):
    plain = batch_mixing.reference()
    run_case(plain, steps=2)  # grads of step 1, weights after step 1
    one = batch_mixing.reference()
    run_case(one, steps=1)    # the weights step 1 starts from
    with open_trace(mha_trace) as trace:
        _assert_every_tensor_once_per_step(trace, plain.model, steps=2)
        rows = _param_rows(trace)
        sites = trace.sites.set_index(["step", "site"])
        assert not any(s.endswith("out_proj#0") for s in trace.sites["site"])
        for block in (0, 1):
            name = f"blocks.{block}.attn.mha.out_proj.weight"
            mine = rows[rows["name"] == name]
            assert sorted(zip(mine["step"], mine["role"], strict=True)) == [
                (0, "weight"), (0, "weight_grad"), (1, "weight"), (1, "weight_grad")]
            assert set(mine["site"]) == {f"blocks.{block}.attn.mha#0"}
            assert set(mine["arg"]) == {"out_proj.weight"}
            # taken inside the call that uses it, as every weight of a site is
            for seq, step in zip(mine.loc[mine["role"] == "weight", "seq"],
                                 mine.loc[mine["role"] == "weight", "step"], strict=True):
                enter, exit_ = sites.loc[(step, f"blocks.{block}.attn.mha#0"),
                                         ["enter_seq", "exit_seq"]]
                assert enter <= seq < exit_
            live = plain.model.blocks[block].attn.mha.out_proj
            assert torch.equal(_read(trace, rows, name, "weight_grad", 1), live.weight.grad)
            assert torch.equal(_read(trace, rows, name, "weight", 1),
                               one.model.blocks[block].attn.mha.out_proj.weight)


def test_load_weights_from_the_trace_gives_every_tensor_bit_for_bit(mha_trace):
    initial = batch_mixing.reference().model.state_dict()
    torch.manual_seed(1234)
    fresh = batch_mixing.AttentionClassifier()
    assert not torch.equal(fresh.blocks[0].attn.mha.out_proj.weight,
                           initial["blocks.0.attn.mha.out_proj.weight"])
    report = load_weights(fresh, mha_trace)
    assert report.unused == []
    assert "blocks.1.attn.mha.out_proj.bias" in report.loaded
    state = fresh.state_dict()
    assert state.keys() == initial.keys()
    for name, value in initial.items():
        assert torch.equal(state[name], value), name


def test_cli_port_with_reference_weights_passes_against_the_reference(run, tmp_path):
    """What failed with MappingError: capture --weights-from a reference with attention."""
    case = "reference_models.batch_mixing:reference"
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    assert run("capture", case, "-o", ref).exit_code == 0
    loaded = run("capture", case, "-o", port, "--weights-from", ref)
    assert loaded.exit_code == 0, loaded.output
    result = run("diff", ref, port)
    assert result.exit_code == 0, result.output


def test_a_perturbed_out_proj_weight_is_the_origin_at_its_attention(mha_trace, tmp_path):
    port = batch_mixing.reference()
    load_weights(port.model, mha_trace)
    with torch.no_grad():
        port.model.blocks[1].attn.mha.out_proj.weight[3, 5] += 0.05
    result = diff(mha_trace, capture(port, tmp_path / "port.h5", steps=2))
    assert not result.passed
    origin = result.origin
    assert (origin.step, origin.site, origin.pass_, origin.role, origin.arg) == (
        0, "blocks.1.attn.mha#0", "forward", "weight", "out_proj.weight")
    assert [o.site for o in result.origins] == ["blocks.1.attn.mha#0"]
    # nothing that runs before it in the forward of step 0 is out
    failing = result.failing()
    early = failing[(failing["step"] == 0) & (failing["pass"] == "forward")]
    assert not early["site"].str.startswith(("blocks.0", "embed", "blocks.1.norm1")).any()


# ---- a port whose attention calls its out_proj pairs with the reference's by full name

class _WrittenOutAttention(nn.Module):
    """nn.MultiheadAttention's parameters under its names, with out_proj called."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, query, key, value, need_weights=True):
        length, batch, d_model = query.shape
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        width = d_model // self.heads

        def heads(x):  # (L, B, D) -> (B, H, L, d)
            return x.reshape(length, batch, self.heads, width).permute(1, 2, 0, 3)

        scores = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(width)
        context = scores.softmax(dim=-1) @ heads(v)
        context = context.permute(2, 0, 1, 3).reshape(length, batch, d_model)
        return self.out_proj(context), None


def _written_out_port() -> Case:
    case = batch_mixing.reference()
    for block in case.model.blocks:
        block.attn.mha = _WrittenOutAttention(batch_mixing.D_MODEL, batch_mixing.HEADS)
    return case


def test_a_port_that_calls_out_proj_loads_and_pairs_with_the_reference(mha_trace, tmp_path):
    port = _written_out_port()
    load_weights(port.model, mha_trace)
    path = capture(port, tmp_path / "port.h5", steps=1)  # Adam's first step: sign(grad)
    with open_trace(path) as trace:
        rows = _param_rows(trace, 0)
        out = rows[rows["name"] == "blocks.0.attn.mha.out_proj.weight"]
        assert list(zip(out["site"], out["arg"], strict=True)) == [
            ("blocks.0.attn.mha.out_proj#0", "weight")] * 2  # weight and weight_grad
    result = diff(mha_trace, path)
    assert result.passed, result.failing()[["site", "role", "arg", "ratio"]]
    params = result.rows[result.rows["role"].isin(PARAM_ROLES)]
    paired = params[params["arg"] == "out_proj.weight"]
    assert len(paired) == 2 * 2  # 2 blocks x (weight, weight_grad)


# ---- a model of our own: nn.TransformerEncoder, whose layers' attention is nn.MHA

class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 8)
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


def _encoder_case(seed: int = 0) -> Case:
    torch.manual_seed(seed)
    model = _Encoder()
    x = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(0))  # whatever the seed
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0,
                steps=2, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_transformer_encoder_layers_give_all_their_weights(tmp_path):
    ref = capture(_encoder_case(), tmp_path / "ref.h5")  # dropout on: the seed replays it
    initial = _encoder_case().model.state_dict()
    with open_trace(ref) as trace:
        _assert_every_tensor_once_per_step(trace, _encoder_case().model, steps=2)
        rows = _param_rows(trace, 0)
        out = rows[rows["name"] == "encoder.layers.1.self_attn.out_proj.bias"]
        assert set(zip(out["site"], out["arg"], strict=True)) == {
            ("encoder.layers.1.self_attn#0", "out_proj.bias")}
    port = _encoder_case(seed=7)
    load_weights(port.model, ref)
    for name, value in port.model.state_dict().items():
        assert torch.equal(value, initial[name]), name
    result = diff(ref, capture(port, tmp_path / "port.h5"))
    assert result.passed and result.rows["ratio"].max() == 0


# ---- ties and odd call patterns keep one record per tensor per step

class _TiedToUncalled(nn.Module):
    """``proj`` is registered first and never called (the forward applies its weight with
    F.linear); ``head`` shares its weight and is called."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.head.weight = self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(F.linear(x, self.proj.weight, self.proj.bias)))


def test_a_tied_weight_whose_owner_is_never_called(tmp_path):
    torch.manual_seed(0)
    case = Case(model=_TiedToUncalled(), inputs=(torch.randn(3, 4),),
                loss_fn=lambda out: out.square().sum(), steps=2,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    path = capture(case, tmp_path / "t.h5")
    with open_trace(path) as trace:
        # the meta names the tensor as its records spell it
        assert trace.meta["shared_parameters"] == [
            {"name": "proj.weight", "users": ["proj.weight", "head.weight"]}]
        for step in (0, 1):
            rows = _param_rows(trace, step)
            assert sorted(zip(rows["name"], rows["site"], rows["role"], strict=True)) == [
                ("head.bias", "head#0", "weight"), ("head.bias", "head#0", "weight_grad"),
                ("proj.bias", "<root>#0", "weight"), ("proj.bias", "<root>#0", "weight_grad"),
                ("proj.weight", "<root>#0", "weight"),
                ("proj.weight", "<root>#0", "weight_grad")]
        rows = _param_rows(trace)
        # the whole tied gradient, the head's part and proj's summed
        assert torch.equal(_read(trace, rows, "proj.weight", "weight_grad", 1),
                           case.model.proj.weight.grad)


class _LateNorm(nn.Module):
    """``enc.norm`` is called by the model after ``enc`` has returned, not inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Module()
        self.enc.lin = nn.Linear(4, 4)
        self.enc.norm = nn.LayerNorm(4)
        self.enc.forward = lambda x: self.enc.lin(x)  # an instance forward: norm not called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc.norm(self.enc(x))


def test_an_owner_first_called_after_its_ancestor_returned_is_recorded_once(tmp_path):
    torch.manual_seed(0)
    case = Case(model=_LateNorm(), inputs=(torch.randn(3, 4),),
                loss_fn=lambda out: out.square().sum(), steps=2,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    path = capture(case, tmp_path / "t.h5")
    with open_trace(path) as trace:
        _assert_every_tensor_once_per_step(trace, case.model, steps=2)
        rows = _param_rows(trace)
        norm = rows[rows["name"].str.startswith("enc.norm.")]
        # not yet called when enc's call returned: enc holds it, the same way every step
        assert set(zip(norm["site"], norm["arg"], strict=True)) == {
            ("enc#0", "norm.weight"), ("enc#0", "norm.bias")}
        assert "enc.norm#0" in set(trace.sites["site"])
    fresh = _LateNorm()
    load_weights(fresh, path)


def test_recording_one_later_step_records_out_proj_there(tmp_path):
    path = capture(batch_mixing.reference(), tmp_path / "t.h5", steps=3, record_steps=[2])
    with open_trace(path) as trace:
        rows = _param_rows(trace)
        assert set(rows["step"]) == {2}
        _assert_every_tensor_once_per_step_at(trace, 2)


def _assert_every_tensor_once_per_step_at(trace, step: int) -> None:
    names = list(batch_mixing.reference().model.state_dict())
    rows = _param_rows(trace, step)
    assert sorted(rows.loc[rows["role"] == "weight", "name"]) == sorted(names)
    assert sorted(rows.loc[rows["role"] == "weight_grad", "name"]) == sorted(names)


def test_a_trace_from_before_says_to_capture_the_reference_again(tmp_path, monkeypatch,
                                                                   mha_trace):
    from layerdiff.capture import hooks, torch_capture
    from layerdiff.errors import MappingError

    # what a capture made before uncalled modules' tensors were recorded wrote
    monkeypatch.setattr(hooks.ModuleRecorder, "_adopt_uncalled", lambda *args: None)
    meta = torch_capture._meta
    monkeypatch.setattr(torch_capture, "_meta", lambda *args: {
        k: v for k, v in meta(*args).items() if k != "uncalled_weights"})
    old = capture(batch_mixing.reference(), tmp_path / "old.h5")
    with pytest.raises(MappingError) as raised:
        load_weights(batch_mixing.AttentionClassifier(), old)
    message = str(raised.value)
    assert ("never called modules blocks.0.attn.mha.out_proj, blocks.1.attn.mha.out_proj "
            in message)
    assert "capture the reference again" in message
    assert str(old) in message and message.count(". ") == 0
    # a trace of today lacks nothing of its model: a name it lacks is the mapping's business
    renamed = batch_mixing.AttentionClassifier()
    for block in renamed.blocks:
        block.attn.attention = block.attn.mha
        del block.attn.mha
    with pytest.raises(MappingError) as raised:
        load_weights(renamed, mha_trace)
    assert "capture the reference again" not in str(raised.value)
    assert "add [[site]] or [[param]] rules" in str(raised.value)


def test_the_diff_table_shows_a_long_argument_name_whole():
    import pandas as pd

    from layerdiff.report.terminal import format_rows

    rows = pd.DataFrame([{"step": 0, "pass": "forward", "site": "blocks.1.attn.mha#0",
                          "role": "weight", "arg": "out_proj.weight", "ratio": 12.0,
                          "max_abs": 0.05, "cosine": 0.99, "status": "origin", "verdict": "out"}])
    table = format_rows(rows)
    assert "out_proj.weight" in table and max(len(line) for line in table.splitlines()) <= 100
