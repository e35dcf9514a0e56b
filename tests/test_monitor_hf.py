"""layerdiff.monitor on a real pair: Hugging Face's GPT2LMHeadModel (tiny random config) and an
independent port with its own names (separate q, k, v; nn.Linear where GPT-2 has Conv1D),
trained alike with AdamW under the monitor. The port's second block's second layer norm takes
another epsilon from step DEPART on: the diff of the two monitored runs names that step and
that norm; the faithful port passes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import layerdiff
from layerdiff.compare.result import Diff

transformers = pytest.importorskip("transformers")

DEPART = 20
STEPS = DEPART + 1
EVERY = 4  # records 0, 4, ..., 20: DEPART is on the grid, the steps between cost nothing
VOCAB, CTX, WIDTH, HEADS = 64, 16, 32, 2

# drafted by `layerdiff map-suggest` on a marked step of the reference's monitored run,
# then checked: the draft paired the norms' gain and shift the wrong way round
MAPPING = """
version = 1

[[site]]
reference = "transformer.h.*.attn.c_proj"
port = "blocks.*.attn.out"

[[site]]
reference = "transformer.h.*.mlp.c_fc"
port = "blocks.*.up"

[[site]]
reference = "transformer.h.*.mlp.c_proj"
port = "blocks.*.down"

[[site]]
reference = "transformer.h.*.ln_1"
port = "blocks.*.norm1"

[[site]]
reference = "transformer.h.*.attn"
port = "blocks.*.attn"

[[site]]
reference = "transformer.h.*.ln_2"
port = "blocks.*.norm2"

[[site]]
reference = "transformer.h.*"
port = "blocks.*"

[[site]]
reference = "transformer.wte"
port = "tok"

[[site]]
reference = "transformer.wpe"
port = "pos"

[[site]]
reference = "transformer.ln_f"
port = "final_norm"

[[site]]
reference = "lm_head"
port = "unembed"

[[unmatched]]
reference = "transformer"
why = "type GPT2Model; no tensors; no port call fits it"

[[unmatched]]
reference = "transformer.drop"
why = "type Dropout; no tensors; no port call fits it"

[[unmatched]]
reference = "transformer.h.*.attn.c_attn"
why = "type Conv1D; no port call fits it; its tensors feed the port's q, k and v"

[[unmatched]]
reference = "transformer.h.*.attn.resid_dropout"
why = "type Dropout; no tensors; no port call fits it"

[[unmatched]]
reference = "transformer.h.*.mlp"
why = "type GPT2MLP; no tensors; no port call fits it"

[[unmatched]]
reference = "transformer.h.*.mlp.act"
why = "type NewGELUActivation; no tensors; no port call fits it"

[[unmatched]]
reference = "transformer.h.*.mlp.dropout"
why = "type Dropout; no tensors; no port call fits it"

[[unmatched]]
port = "blocks.*.attn.q"
why = "type Linear; no reference call fits it"

[[unmatched]]
port = "blocks.*.attn.k"
why = "type Linear; no reference call fits it"

[[unmatched]]
port = "blocks.*.attn.v"
why = "type Linear; no reference call fits it"

[[param]]
port = "blocks.*.norm1.gain"
reference = "transformer.h.*.ln_1.weight"

[[param]]
port = "blocks.*.norm1.shift"
reference = "transformer.h.*.ln_1.bias"

[[param]]
port = "blocks.*.norm2.gain"
reference = "transformer.h.*.ln_2.weight"

[[param]]
port = "blocks.*.norm2.shift"
reference = "transformer.h.*.ln_2.bias"

[[param]]
port = "final_norm.gain"
reference = "transformer.ln_f.weight"

[[param]]
port = "final_norm.shift"
reference = "transformer.ln_f.bias"

[[param]]
port = ["blocks.*.attn.q.weight", "blocks.*.attn.k.weight", "blocks.*.attn.v.weight"]
reference = "transformer.h.*.attn.c_attn.weight"
transform = ["transpose", "split"]

[[param]]
port = ["blocks.*.attn.q.bias", "blocks.*.attn.k.bias", "blocks.*.attn.v.bias"]
reference = "transformer.h.*.attn.c_attn.bias"
transform = "split"

[[param]]
port = "blocks.*.attn.out.weight"
reference = "transformer.h.*.attn.c_proj.weight"
transform = "transpose"

[[param]]
port = "blocks.*.up.weight"
reference = "transformer.h.*.mlp.c_fc.weight"
transform = "transpose"

[[param]]
port = "blocks.*.down.weight"
reference = "transformer.h.*.mlp.c_proj.weight"
transform = "transpose"
"""


def reference() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=CTX, n_embd=WIDTH, n_layer=2, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config)


class Norm(nn.Module):
    def __init__(self, clock: list[int], slips: bool = False) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))
        self.shift = nn.Parameter(torch.zeros(WIDTH))
        self.clock, self.slips = clock, slips  # the loop's step, in a list the loop updates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = 1e-2 if self.slips and self.clock[0] >= DEPART else 1e-5
        return F.layer_norm(x, (WIDTH,), self.gain, self.shift, eps)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, HEADS, d // HEADS).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // HEADS)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, clock: list[int], slips: bool) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = Norm(clock), Attention(), Norm(clock, slips)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class Port(nn.Module):
    def __init__(self, slips: bool) -> None:
        super().__init__()
        self.clock = [0]
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CTX, WIDTH)
        self.blocks = nn.ModuleList(Block(self.clock, slips and i == 1) for i in range(2))
        self.final_norm = Norm(self.clock)
        self.unembed = nn.Linear(WIDTH, VOCAB, bias=False)
        self.unembed.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.final_norm(x))


@torch.no_grad()
def port_of(ref: nn.Module, slips: bool) -> Port:
    port, t = Port(slips), ref.transformer
    port.tok.weight.copy_(t.wte.weight)
    port.pos.weight.copy_(t.wpe.weight)
    for block, theirs in zip(port.blocks, t.h, strict=True):
        qkv_w, qkv_b = theirs.attn.c_attn.weight, theirs.attn.c_attn.bias  # Conv1D: (in, out)
        for i, linear in enumerate((block.attn.q, block.attn.k, block.attn.v)):
            linear.weight.copy_(qkv_w[:, i * WIDTH:(i + 1) * WIDTH].T)
            linear.bias.copy_(qkv_b[i * WIDTH:(i + 1) * WIDTH])
        for mine, conv in ((block.attn.out, theirs.attn.c_proj), (block.up, theirs.mlp.c_fc),
                           (block.down, theirs.mlp.c_proj)):
            mine.weight.copy_(conv.weight.T)
            mine.bias.copy_(conv.bias)
        for mine, norm in ((block.norm1, theirs.ln_1), (block.norm2, theirs.ln_2)):
            mine.gain.copy_(norm.weight)
            mine.shift.copy_(norm.bias)
    port.final_norm.gain.copy_(t.ln_f.weight)
    port.final_norm.shift.copy_(t.ln_f.bias)
    return port


def train(model: nn.Module, path) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    with layerdiff.monitor(model, path, every=EVERY, optimizer=opt):
        for step in range(STEPS):
            if isinstance(model, Port):
                model.clock[0] = step
            ids = torch.randint(0, VOCAB, (4, CTX), generator=generator)
            out = model(ids)
            logits = out.logits if hasattr(out, "logits") else out
            F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("monitor_hf")
    (folder / "pair.map.toml").write_text(MAPPING)
    for name, model in (("ref", reference()), ("good", port_of(reference(), slips=False)),
                        ("bug", port_of(reference(), slips=True))):
        train(model, folder / f"{name}.h5")
    return folder


def _diff(folder, port: str) -> Diff:
    return layerdiff.diff(folder / "ref.h5", folder / f"{port}.h5",
                          mapping=folder / "pair.map.toml")


def test_the_port_that_slips_at_step_20_is_named_there_at_its_norm(runs):
    result = _diff(runs, "bug")
    assert not result.passed
    assert result.first_failing_step == DEPART
    assert result.origin.site == "transformer.h.1.ln_2#0"
    assert result.origin.role == "output"
    assert result.origin.port_site == "blocks.1.norm2#0"


def test_the_faithful_port_passes(runs):
    result = _diff(runs, "good")
    assert result.passed, result.origin
    assert set(result.rows["step"]) == set(range(0, STEPS, EVERY))
