"""Call adapters: replay, swap and bisect judge a Hugging Face Llama attention against a
llama2.c-style port whose attention takes other arguments.

Real transformers 5.x calls its attention as ``self_attn(hidden_states=h, position_embeddings=
(cos, sin), attention_mask=m, position_ids=p, past_key_values=cache, use_cache=True)`` with
``cos``/``sin`` of shape (1, T, head_dim) (rotate-half layout: each frequency twice) and gets
``(output, attn_weights)`` back. The port's ``Attention.forward(x, freqs_cos, freqs_sin)`` takes
(T, head_dim/2) and returns the output alone, and its block calls it (and its feed-forward)
through ``.forward()``. No renaming can make one call from the other: the mapping names a call
adapter (``attention_call`` below) that slices the frequencies out of ``cos``/``sin``.

The port rotates q and k in HF's rotate-half layout (the frequencies at i and i + head_dim/2
pair up), so its weights load from the reference's unchanged; a port that interleaves the pairs
needs the standard per-head row permutation of q and k as a conversion, which is not what these
tests are about.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture
from layerdiff.errors import MappingError
from layerdiff.replay import Swapper, bisect, replay, swap
from layerdiff.replay.bisect import BisectOutcome
from layerdiff.replay.swap import SwapOutcome

transformers = pytest.importorskip("transformers")

HERE = "tests.test_call_adapters"
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB, T, BATCH = 64, 2, 4, 2, 128, 16, 2
HEAD_DIM = HIDDEN // HEADS
ATTN0 = "layers.0.attention"
REF_ATTN0 = "model.layers.0.self_attn"
LOSS_SCALE = 2.0 ** 20


# ---- the call adapters a user writes (named in the mapping as tests.test_call_adapters:...)

def _frequencies(position_embeddings):
    cos, sin = position_embeddings                 # (1, T, head_dim), each frequency twice
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]      # (T, head_dim/2)


def attention_call(hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """HF attention's call -> the port's ``Attention.forward(x, freqs_cos, freqs_sin)`` (the
    port builds its own causal mask)."""
    return (hidden_states, *_frequencies(position_embeddings)), {}


def block_call(hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
               use_cache=False, position_embeddings=None, **kwargs):
    """HF decoder layer's call -> the port's ``TransformerBlock.forward(x, cos, sin)``."""
    return (hidden_states, *_frequencies(position_embeddings)), {}


def raising_call(hidden_states, **kwargs):
    raise ValueError("no frequencies here")


def wrong_shape_call(hidden_states, **kwargs):
    return hidden_states


# ---- a llama2.c-style port

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (i, i + head_dim/2) of ``x`` (B, T, H, head_dim) by frequency i."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, scale_bug: bool = False) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.scale_bug = scale_bug

    def forward(self, x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor
                ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, HEADS, HEAD_DIM)
        k = self.wk(x).view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        v = self.wv(x).view(bsz, seqlen, KV_HEADS, HEAD_DIM)
        q, k = _rotate(q, freqs_cos, freqs_sin), _rotate(k, freqs_cos, freqs_sin)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=2)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scale = 1.0 if self.scale_bug else 1.0 / math.sqrt(HEAD_DIM)  # the planted bug
        scores = (q @ k.transpose(-1, -2)) * scale
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.w2 = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, scale_bug: bool = False) -> None:
        super().__init__()
        self.attention = Attention(scale_bug)
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(HIDDEN)
        self.ffn_norm = RMSNorm(HIDDEN)

    def forward(self, x, freqs_cos, freqs_sin):
        # as llama2.c does: the children are called through .forward(), no hooks run
        h = x + self.attention.forward(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, bug_in: int | None = None) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(TransformerBlock(scale_bug=i == bug_in)
                                    for i in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        freqs = torch.outer(torch.arange(T).float(), inv_freq)
        self.register_buffer("freqs_cos", freqs.cos(), persistent=False)
        self.register_buffer("freqs_sin", freqs.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = self.freqs_cos[:tokens.shape[1]], self.freqs_sin[:tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


# ---- cases

def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, T + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _loss(targets: torch.Tensor):
    def loss(out) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    return loss


def reference() -> Case:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
        max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    tokens, targets = _tokens()
    return Case(model=model, inputs=(tokens,), loss_fn=_loss(targets), name=f"{HERE}:reference")


def port(bug_in: int | None = None) -> Case:
    torch.manual_seed(0)
    tokens, targets = _tokens()
    name = "port" if bug_in is None else "port_bug_attn_scale"
    return Case(model=Transformer(bug_in), inputs=(tokens,), loss_fn=_loss(targets),
                name=f"{HERE}:{name}")


def port_bug_attn_scale() -> Case:
    """Block 0's attention does not scale its scores."""
    return port(bug_in=0)


class _BuggyFeedForward(FeedForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x)) * self.w3(x))  # relu where silu belongs


def port_bug_mlp() -> Case:
    """Block 0's feed-forward uses relu: a bug in a module the port calls through .forward()."""
    case = dataclasses.replace(port(), name=f"{HERE}:port_bug_mlp")
    case.model.layers[0].feed_forward.__class__ = _BuggyFeedForward
    return case


# ---- the mapping

SITES = """version = 1

[[site]]
reference = "model.layers.*.self_attn"
port = "layers.*.attention"
call = "{attention}"

[[site]]
reference_regex = '^model\\.layers\\.(\\d+)$'
port = 'layers.\\1'
call = "tests.test_call_adapters:block_call"
{rest}"""

MODULES = [("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
           ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
           ("mlp", "feed_forward"), ("mlp.gate_proj", "feed_forward.w1"),
           ("mlp.down_proj", "feed_forward.w2"), ("mlp.up_proj", "feed_forward.w3"),
           ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm")]

REST = "".join(f'\n[[site]]\nreference = "model.layers.*.{ref}"\nport = "layers.*.{port}"\n'
               for ref, port in MODULES) + """
[[site]]
reference = "model.embed_tokens"
port = "tok_embeddings"

[[site]]
reference = "model.norm"
port = "norm"

[[site]]
reference = "lm_head"
port = "output"

[[unmatched]]
reference = "model"
why = "the port's root walks its layers itself"

[[unmatched]]
reference = "model.rotary_emb"
why = "the port precomputes its frequencies as buffers"

[[unmatched]]
reference = "model.layers.*.self_attn"
output = "1"
why = "the eager attention's weights: the block throws them away, the port returns none"
"""


def write_mapping(directory: Path, attention: str = f"{HERE}:attention_call",
                  name: str = "llama.map.toml") -> Path:
    path = directory / name
    path.write_text(SITES.format(attention=attention, rest=REST), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def mapping(tmp_path_factory) -> Path:
    return write_mapping(tmp_path_factory.mktemp("map"))


@pytest.fixture(scope="module")
def reference_trace(tmp_path_factory) -> Path:
    return capture(reference(), tmp_path_factory.mktemp("llama") / "reference.h5",
                   loss_scale=LOSS_SCALE)


def _forward_local(result, site: str):
    table = result.local
    return table[(table["port_site"] == site) & (table["pass"] == "forward")].iloc[0]


# ---- replay

def test_the_faithful_port_replays_within_tolerance_through_the_adapters(reference_trace,
                                                                          mapping):
    result = replay(reference_trace, port(), mapping=mapping, propagated=False)
    assert not result.cannot_judge, result.cannot_judge
    replayed = dict(result.replayed)
    assert replayed[f"{REF_ATTN0}#0"] == f"{ATTN0}#0"
    assert replayed["model.layers.1#0"] == "layers.1#0"
    for site in (f"{ATTN0}#0", "layers.1.attention#0", "layers.0#0"):
        assert _forward_local(result, site)["local"] <= 1, result.local
    assert (result.local["verdict"] != "LOCAL ERROR").all(), result.local
    # the attention's input gradient went back through the adapter to the reference's own
    # argument, and is compared with the reference's under its name
    rows = result.diff.rows
    grad = rows[(rows["port_site"] == f"{ATTN0}#0") & (rows["role"] == "grad_input")]
    assert set(grad["arg"]) == {"hidden_states"} and (grad["ratio"] <= 1).all()


def test_an_attention_scale_bug_is_a_local_error_at_the_attention(reference_trace, mapping):
    result = replay(reference_trace, port_bug_attn_scale(), mapping=mapping, propagated=False)
    assert not result.cannot_judge and result.outcome == "fail" and not result
    table = result.local
    local = table[table["verdict"] == "LOCAL ERROR"]
    found = set(local[local["pass"] == "forward"]["port_site"])
    # the block around it holds the attention, so replayed whole it errs too; which of the
    # two the diff names the origin is the diff's to say (its attention weights, output 1,
    # have no partner in the port)
    assert f"{ATTN0}#0" in found and found <= {f"{ATTN0}#0", "layers.0#0"}, table
    assert _forward_local(result, f"{ATTN0}#0")["local"] > 10
    assert _forward_local(result, "layers.1.attention#0")["local"] <= 1


def test_an_adapter_that_raises_is_cannot_judge_in_one_sentence(reference_trace, tmp_path):
    mapping = write_mapping(tmp_path, f"{HERE}:raising_call")
    result = replay(reference_trace, port(), mapping=mapping, propagated=False)
    why = dict(result.cannot_judge)[f"{REF_ATTN0}#0"]
    assert why == (f"CannotCall: port layer {ATTN0}: the call adapter "
                   f"'{HERE}:raising_call' ({mapping} line 3) raised ValueError: no "
                   "frequencies here; fix the function, or the mapping's call line")
    assert result.outcome == "cannot-judge" and not result
    # the other layers are judged all the same
    assert ("model.layers.0.mlp#0", "layers.0.feed_forward#0") in result.replayed


def test_an_adapter_that_returns_no_call_is_cannot_judge(reference_trace, tmp_path):
    mapping = write_mapping(tmp_path, f"{HERE}:wrong_shape_call")
    result = replay(reference_trace, port(), mapping=mapping, propagated=False)
    why = dict(result.cannot_judge)[f"{REF_ATTN0}#0"]
    assert f"({mapping} line 3) returned float32 (2,16,64), not (args, kwargs)" in why, why
    assert "\n" not in why


def test_an_adapter_that_does_not_import_is_refused_naming_its_line(reference_trace,
                                                                    tmp_path):
    mapping = write_mapping(tmp_path, "tests.no_such_module:attention_call")
    with pytest.raises(MappingError, match=rf"{mapping.name} line 3: .*does not import"):
        replay(reference_trace, port(), mapping=mapping, propagated=False)


def test_without_an_adapter_the_sentence_says_which_adapter_to_write(reference_trace,
                                                                     tmp_path):
    mapping = tmp_path / "no_adapter.map.toml"
    mapping.write_text(SITES.format(attention=f"{HERE}:attention_call", rest=REST).replace(
        f'call = "{HERE}:attention_call"\n', ""), encoding="utf-8")
    result = replay(reference_trace, port(), mapping=mapping, propagated=False)
    why = dict(result.cannot_judge)[f"{REF_ATTN0}#0"]
    assert "the port's Attention.forward(x, freqs_cos, freqs_sin) needs 'freqs_cos' and " \
           "'freqs_sin', which the reference's call does not give" in why, why
    assert "hidden_states float32 (2,16,64)" in why
    assert "position_embeddings (float32 (1,16,16), float32 (1,16,16))" in why
    assert "attention_mask float32 (2,1,16,16)" in why
    assert why.endswith('call = "your_module:adapter"') and "\n" not in why


# ---- "not taken by the port"

class _AttentionTakingHFFrequencies(Attention):
    """A port attention that takes HF's (cos, sin) itself and builds its own causal mask: the
    reference's attention_mask, position_ids, cache and use_cache have no parameter here."""

    def forward(self, hidden_states, position_embeddings):
        return super().forward(hidden_states, *_frequencies(position_embeddings))


def test_arguments_the_port_does_not_take_are_listed_and_the_layer_judged(reference_trace,
                                                                          mapping, tmp_path):
    case = port()
    for block in case.model.layers:
        block.attention.__class__ = _AttentionTakingHFFrequencies
    plain = tmp_path / "plain.map.toml"
    plain.write_text(mapping.read_text(encoding="utf-8").replace(
        f'call = "{HERE}:attention_call"\n', ""), encoding="utf-8")
    result = replay(reference_trace, case, mapping=plain, propagated=False)
    assert f"{REF_ATTN0}#0" not in dict(result.cannot_judge), result.cannot_judge
    not_taken = dict(result.not_taken[f"{ATTN0}#0"])
    assert not_taken["attention_mask"] == "float32 (2,1,16,16)"
    assert not_taken["position_ids"] == "int64 (1,16)"
    # a cache object where transformers passes one (5.18 does, 5.24 does not): not plain data
    assert not_taken.get("past_key_values", "DynamicCache, not plain data") == \
        "DynamicCache, not plain data"
    assert "hidden_states" not in not_taken and "position_embeddings" not in not_taken
    assert _forward_local(result, f"{ATTN0}#0")["local"] <= 1
    rows = result.diff.rows
    rows = rows[rows["port_site"] == f"{ATTN0}#0"]
    assert "attention_mask" not in set(rows["arg"])  # left out of the input check
    assert "cannot-judge" not in set(rows["status"])


def test_the_report_lists_what_the_port_did_not_take(run, reference_trace, tmp_path):
    case_map = tmp_path / "plain.map.toml"
    case_map.write_text(SITES.format(attention=f"{HERE}:attention_call", rest=REST).replace(
        f'call = "{HERE}:attention_call"\n', ""), encoding="utf-8")
    out = run("replay", reference_trace, f"{HERE}:port_attention_taking_hf_frequencies",
              "--map", case_map)
    assert "not taken by the port at layers.0.attention#0: attention_mask (float32 " \
           "(2,1,16,16))" in " ".join(out.output.split()), out.output


def port_attention_taking_hf_frequencies() -> Case:
    case = dataclasses.replace(port(), name=f"{HERE}:port_attention_taking_hf_frequencies")
    for block in case.model.layers:
        block.attention.__class__ = _AttentionTakingHFFrequencies
    return case


# ---- swap and bisect

@pytest.fixture(scope="module")
def buggy_swapper(mapping):
    return Swapper(reference, port_bug_attn_scale, mapping)


def test_swapping_the_faithful_attention_in_through_the_adapter_stays_within(mapping):
    result = swap(reference, port, [REF_ATTN0], mapping=mapping)
    assert result.outcome == SwapOutcome.WITHIN, result.describe()
    assert result.swapped == [(REF_ATTN0, ATTN0)]
    # the reference's gradients w.r.t. its own weights around the attention came back
    # through the adapter and the port's attention
    grads = [row for row in result.rows if row.role == "weight_grad"]
    assert any("q_proj" in row.what for row in grads) and all(row.ratio <= 1 for row in grads)


def test_swapping_the_buggy_attention_in_breaks_the_reference(buggy_swapper):
    result = buggy_swapper.run([ATTN0])
    assert result.outcome == SwapOutcome.BREAKS and result.ratio > 10, result.describe()


def test_swapping_an_adapter_that_raises_is_cannot_judge(tmp_path):
    mapping = write_mapping(tmp_path, f"{HERE}:raising_call")
    result = swap(reference, port, [REF_ATTN0], mapping=mapping)
    assert result.outcome == SwapOutcome.CANNOT_JUDGE and not result
    layer, why = result.not_swapped[0]
    assert layer == ATTN0
    assert f"the call adapter '{HERE}:raising_call' ({mapping} line 3) raised ValueError: " \
           "no frequencies here" in why and "\n" not in result.describe()


def test_bisect_names_the_attention(buggy_swapper):
    result = bisect(buggy_swapper)
    assert result.outcome == BisectOutcome.CULPRITS, result.as_json()
    assert result.culprits == [(REF_ATTN0, ATTN0)]
    assert not result.not_swapped


def test_bisect_of_the_faithful_port_has_nothing_to_find(mapping):
    result = bisect(Swapper(reference, port, mapping))
    assert result.outcome == BisectOutcome.NOTHING_TO_FIND, result.as_json()


def test_modules_the_port_calls_through_forward_pair_for_swap(mapping):
    swapper = Swapper(reference, port, mapping)
    assert swapper.pairs[REF_ATTN0][0] == ATTN0
    assert swapper.pairs["model.layers.0.mlp"][0] == "layers.0.feed_forward"


def test_a_layer_swapped_into_the_port_is_the_one_its_forward_call_runs(mapping):
    """The port calls its feed-forward through ``.forward()``: with the reference's MLP put in
    its place the buggy port matches the reference, so the replacement is what ran."""
    swapper = Swapper(reference, port_bug_mlp, mapping)
    assert swapper.run(["model.layers.0.mlp"]).outcome == SwapOutcome.BREAKS
    fixed = swapper.run(["layers.0.feed_forward"], into="port")
    assert fixed.outcome == SwapOutcome.WITHIN, fixed.describe()


def test_a_layer_with_a_call_adapter_cannot_go_into_the_port(mapping):
    result = swap(reference, port, [ATTN0], mapping=mapping, into="port")
    assert result.outcome == SwapOutcome.CANNOT_JUDGE
    assert "the reverse, to call the reference's layer from the port's code, is not written" \
        in result.not_swapped[0][1]


def test_a_rule_with_call_takes_no_args(tmp_path):
    from layerdiff.mapping import Mapping

    path = tmp_path / "both.map.toml"
    path.write_text('[[site]]\nreference = "a"\nport = "b"\ncall = "m:f"\n'
                    'args = { attention_mask = "" }\n', encoding="utf-8")
    with pytest.raises(MappingError, match="call makes the port's call alone"):
        Mapping.load(path)


# ---- gradients through an adapter, on a model small enough to reason about

D = 8


class _GatedReference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, hidden, gate):           # gate: (B, 2D); only its first half is used
        return self.lin(hidden) * gate[..., :D]


class _GatedPort(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, g):                   # g: (B, D)
        return self.lin(x) * g


def gate_call(hidden, gate):
    return (hidden, gate[..., :D]), {}


class _GatedNet(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.gate_proj = nn.Linear(D, 2 * D)
        self.layer = layer
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        gate = torch.sigmoid(self.gate_proj(h))
        if isinstance(self.layer, _GatedPort):  # the port's own code passes the half it uses
            gate = gate[..., :D]
        return self.head(self.layer(h, gate))


def _gated(layer: nn.Module, name: str) -> Case:
    torch.manual_seed(0)
    model = _GatedNet(layer)
    x, y = torch.randn(4, D), torch.arange(4) % 3
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, y),
                name=f"{HERE}:{name}")


def gated_reference() -> Case:
    return _gated(_GatedReference(), "gated_reference")


def gated_port() -> Case:
    return _gated(_GatedPort(), "gated_port")


@pytest.fixture
def gate_mapping(tmp_path) -> Path:
    path = tmp_path / "gate.map.toml"
    path.write_text(f'[[site]]\nreference = "layer"\nport = "layer"\ncall = "{HERE}:gate_call"\n',
                    encoding="utf-8")
    return path


def test_replayed_input_gradients_flow_through_the_adapter_to_the_reference_arguments(
        tmp_path, gate_mapping):
    """The reference's gradient for ``gate`` is (B, 2D), zero in its second half; the replayed
    one is taken through the adapter's slice, so it has the reference's shape and name."""
    ref = capture(gated_reference(), tmp_path / "ref.h5")
    result = replay(ref, gated_port(), mapping=gate_mapping, propagated=False)
    assert result and not result.cannot_judge, result.cannot_judge
    rows = result.diff.rows
    grads = rows[(rows["port_site"] == "layer#0") & (rows["role"] == "grad_input")]
    # the reference called layer(h, gate): its arguments 0 and 1, gate's gradient (4, 16)
    assert set(grads["arg"]) == {"0", "1"} and (grads["ratio"] <= 1).all(), grads


def test_swap_through_the_adapter_gives_the_reference_its_own_gradients(gate_mapping):
    result = swap(gated_reference, gated_port, ["layer"], mapping=gate_mapping)
    assert result.outcome == SwapOutcome.WITHIN, result.describe()
    grads = {row.what.split(",")[0] for row in result.rows if row.role == "weight_grad"}
    # gate_proj's gradient reaches it only through the adapter's slice
    assert "weight_grad gate_proj.weight" in grads and "weight_grad inp.weight" in grads


def test_a_port_module_runs_on_a_recorded_call_through_its_adapter(reference_trace, mapping):
    """What map-check uses to measure a module: ``TorchPort.outputs`` with the site's adapter."""
    from layerdiff.mapping import Mapping
    from layerdiff.replay.recorded import recorded_calls
    from layerdiff.replay.torch_replay import TorchPort
    from layerdiff.trace import open_trace
    from layerdiff.weights import load_weights

    loaded = Mapping.load(mapping)
    case = port()
    load_weights(case.model, reference_trace, loaded)
    with open_trace(reference_trace) as ref:
        call = next(c for c in recorded_calls(ref) if c.site == f"{REF_ATTN0}#0")
        runner = TorchPort(case.model, ref)
        adapter = loaded.call_adapter(call.site)
        out = runner.outputs(call, ATTN0, {}, runner.inputs(call, {}),
                             adapter=(adapter, adapter.resolve()))
        expected = ref.read(ref.records(0, call.site, "output").iloc[0])
    assert torch.allclose(out, torch.as_tensor(expected), rtol=1e-5, atol=1e-6)
