"""Calling a port layer with the reference's recorded arguments, fitted to its own signature:
each binding rule of ``layerdiff.replay.calling`` on plain functions, then replay end to end
with a reference whose layer takes Hugging Face-style keywords and a port whose takes ``x``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, DiffError, capture
from layerdiff.replay import replay
from layerdiff.replay.calling import BoundCall, CannotCall, Signature, bind_call
from layerdiff.signature import Parameter
from layerdiff.trace import open_trace
from layerdiff.trace.arguments import NotPlainData, dropped_arguments, map_argument


def replay_outcome(result) -> tuple[dict[str, str], set[str], dict[str, list]]:
    """(reference site -> why it failed, replayed port sites, port site -> dropped arguments)
    of a replay result: the one place that knows where replay keeps them."""
    return dict(result.cannot_judge), {port for _, port in result.replayed}, result.dropped


# ---- plain functions as layers
def attention(x, mask=None):
    return x, mask


def hf_attention(hidden_states, past_key_values=None, attention_mask=None,
                 output_attentions=False, eps=1e-5, **kwargs):
    return hidden_states


def only_x(x):
    return x


PORT = Signature.of(attention)
HF = Signature.of(hf_attention)


def call_of(bound: BoundCall, fn):
    args, kwargs = bound.call()
    return fn(*args, **kwargs)


NOT_PLAIN = object()


def test_signature_reads_kinds_and_defaults_as_json():
    def f(a, /, b, c=None, *args, d=False, e=1e-5, f=NOT_PLAIN, **kwargs):
        pass

    sig = Signature.of(f)
    assert [(p.name, p.kind, p.has_default, p.default) for p in sig.params] == [
        ("a", "positional_only", False, None), ("b", "positional", False, None),
        ("c", "positional", True, "null"), ("args", "var_positional", False, None),
        ("d", "keyword_only", True, "false"), ("e", "keyword_only", True, "1e-05"),
        ("f", "keyword_only", True, None), ("kwargs", "var_keyword", False, None)]
    assert sig.name == "f"  # the enclosing test's "<locals>" says nothing to a user
    assert sig.describe() == "f(a, /, b, c=None, *args, d=False, e=1e-05, f=..., **kwargs)"


def test_signature_of_a_bound_method_has_no_self_and_a_class_name():
    class Attention(nn.Module):
        def forward(self, x, mask=None, *, scale=1.0):
            return x

    sig = Signature.of(Attention().forward)
    assert sig.describe() == "Attention.forward(x, mask=None, *, scale=1.0)"
    assert Signature.of(42) is None  # not callable: no signature, no error


def test_signature_round_trips_through_json_and_refuses_malformed_data():
    sig = Signature.of(hf_attention)
    data = json.loads(json.dumps(sig.as_json()))
    assert Signature.from_json(data) == sig
    for bad in (None, {"name": "f"}, {"name": "f", "params": [["x", "keyword", False, None]]},
                {"name": "f", "params": [["x", "positional", "no", None]]},
                {"name": "f", "params": [["x", "positional", True, "not json"]]},
                {"name": "f", "params": [["x", "positional"]]}):
        with pytest.raises(DiffError, match="signature") as info:
            Signature.from_json(bad, "ref.h5 meta 'signatures' Attention")
        assert str(info.value).startswith("ref.h5 meta 'signatures' Attention")
        assert str(info.value).count(";") <= 1


def test_a_dropped_head_is_left_out_with_its_nested_parts():  # (a)
    bound = bind_call([("0", 1), ("cache.k", 2), ("cache.v", 3)], PORT, drop={"cache"})
    assert bound.values == [("0", 1)] and bound.dropped == [("cache", "the mapping drops it")]
    assert call_of(bound, attention) == (1, None)


def test_without_a_port_signature_everything_else_passes_as_recorded():  # (b)
    values = [("0", 1), ("1.0", 2), ("1.1", 3), ("mask", None)]
    bound = bind_call(values, None)
    assert bound.values == values and not bound.dropped and not bound.renamed
    # a dropped positional leaves no gap: f(x, cache, y) -> f(x, y)
    bound = bind_call([("0", "x"), ("1", "cache"), ("2", "y")], None, drop={"1"})
    assert bound.call() == (("x", "y"), {})


def test_a_keyword_that_names_a_port_parameter_binds_to_it():  # (c)
    bound = bind_call([("mask", 2), ("0", 1)], PORT)
    assert call_of(bound, attention) == (1, 2)
    # passed by its name, it stays a keyword: a decorated forward (HF 5.x) that takes some
    # arguments from the keywords gets them twice if they come by position too
    assert bound.call() == ((1,), {"mask": 2})
    # a keyword that names a positional parameter takes it; the positional argument moves on
    bound = bind_call([("0", 7), ("x", 1)], PORT)
    assert call_of(bound, attention) == (1, 7)


def test_positional_arguments_fill_free_parameters_then_star_args():  # (d)
    def star(a, *rest):
        return a, rest

    bound = bind_call([("0", 1), ("1.0", 2), ("1.1", 3), ("2", 4)], Signature.of(star))
    assert call_of(bound, star) == (1, ((2, 3), 4))
    # a positional argument past the port's last parameter is not taken, and listed
    bound = bind_call([("0", 1), ("1", 2), ("2", 3)], PORT)
    assert call_of(bound, attention) == (1, 2) and bound.dropped == [("2", "3")]


def test_a_keyword_the_port_lacks_goes_to_kwargs_or_to_the_reference_position():  # (e)
    def open_kwargs(x, **kwargs):
        return x, kwargs

    bound = bind_call([("0", 1), ("extra", 2)], Signature.of(open_kwargs))
    assert call_of(bound, open_kwargs) == (1, {"extra": 2})
    # hidden_states is the reference's first positional parameter: it feeds the port's x
    bound = bind_call([("hidden_states", 5)], Signature.of(only_x), reference=HF)
    assert bound.renamed == {"hidden_states": "0"} and call_of(bound, only_x) == 5
    # without the reference's signature nothing says hidden_states is x: x gets nothing
    with pytest.raises(CannotCall, match=r"needs 'x', .* \(it passes hidden_states 5\)"):
        bind_call([("hidden_states", 5)], Signature.of(only_x))


def test_arguments_without_a_parameter_go_when_none_or_the_reference_default():  # (f)
    values = [("hidden_states", 5), ("past_key_values.0", None), ("past_key_values.1", None),
              ("attention_mask", None), ("output_attentions", False), ("eps", 1e-5)]
    bound = bind_call(values, Signature.of(only_x), reference=HF)
    assert call_of(bound, only_x) == 5
    assert bound.dropped == [("past_key_values", "None"), ("attention_mask", "None"),
                             ("output_attentions", "its default false"),
                             ("eps", "its default 1e-05")]
    # a positional argument is compared with the reference's parameter at its place
    bound = bind_call([("0", 5), ("3", False)], Signature.of(only_x), reference=HF)
    assert ("3", "its default false") in bound.dropped


@pytest.mark.parametrize("name, value, holds", [
    ("output_attentions", True, "True"),        # not the default
    ("output_attentions", 0, "0"),              # 0 == False in Python, not in JSON
    ("attention_mask", np.ones((4, 1, 16, 16)), "float64 (4,1,16,16)"),
    ("attention_mask", (np.ones(2), np.ones((2, 3), np.float32)), "(float64 (2), float32 (2,3))"),
    ("attention_mask", "x" * 60, "'" + "x" * 36 + "..."),
])
def test_an_argument_the_port_has_no_parameter_for_is_not_taken_and_listed(name, value, holds):
    """The port layer computes its output from what it takes: an argument it has no parameter
    for is left out of its call, listed with what it held, never a reason not to judge."""
    bound = bind_call([("hidden_states", 5), (name, value)], Signature.of(only_x), reference=HF,
                      where="port layer transformer.h.0.attn")
    assert call_of(bound, only_x) == 5
    assert bound.dropped == [(name, holds)]


def test_every_argument_the_port_does_not_take_is_listed():
    """Real transformers 5.x passes use_cache=False into the attention's **kwargs and a
    position_ids tensor: both are left out and listed."""
    bound = bind_call([("hidden_states", 5), ("use_cache", False),
                       ("position_ids", np.ones((1, 3), np.int64))],
                      Signature.of(only_x), reference=HF, where="port layer attn")
    assert bound.dropped == [("use_cache", "False"), ("position_ids", "int64 (1,3)")]


def test_a_tensor_never_equals_a_default():
    def takes_default(x, scale=1.0):
        return x

    bound = bind_call([("0", 1), ("scale", torch.tensor(1.0))], Signature.of(only_x),
                      reference=Signature.of(takes_default))
    assert bound.dropped == [("scale", "float32 ()")]  # listed as the tensor, not as a default


def test_a_value_recorded_as_a_repr_is_left_out_or_refused_never_passed():
    """A Hugging Face DynamicCache is recorded as its repr: it cannot be rebuilt, so it may
    be left out of the call, but bound to a port parameter it refuses the call."""
    cache = NotPlainData("DynamicCache", "DynamicCache()")
    bound = bind_call([("0", 1), ("past_key_values", cache)], Signature.of(only_x))
    assert bound.dropped == [("past_key_values", "DynamicCache, not plain data")]

    def open_kwargs(x, **kwargs):
        return x, kwargs

    bound = bind_call([("0", 1), ("past_key_values", cache)], Signature.of(open_kwargs))
    assert call_of(bound, open_kwargs) == (1, {})  # not passed into **kwargs either

    def takes_cache(x, past_key_values=None):
        return x

    with pytest.raises(CannotCall, match="recorded as DynamicCache, not plain data, so it "
                                         "cannot be passed to the port's 'past_key_values'"):
        bind_call([("0", 1), ("past_key_values", cache)], Signature.of(takes_cache))


def test_a_port_parameter_without_a_default_must_get_a_value():  # (g)
    def needs_mask(x, mask):
        return x

    with pytest.raises(CannotCall) as info:
        bind_call([("0", np.ones((2, 4), np.float32)), ("attention_mask", None)],
                  Signature.of(needs_mask), where="port layer attn")
    message = str(info.value)
    assert message.startswith("port layer attn: the port's needs_mask(x, mask) needs 'mask', "
                              "which the reference's call does not give (it passes positional "
                              "argument 0 float32 (2,4), attention_mask None); write a call "
                              "adapter")
    assert message.endswith('[[site]] rule for this layer: call = "your_module:adapter"')

    def needs_two(x, freqs_cos, freqs_sin):
        return x

    with pytest.raises(CannotCall, match="needs 'freqs_cos' and 'freqs_sin', which"):
        bind_call([("0", 1)], Signature.of(needs_two))


def test_the_call_goes_by_position_up_to_a_gap_then_by_keyword():  # (h)
    def gapped(a, b=0, c=0, *, d=0):
        return a, b, c, d

    bound = bind_call([("0", 1), ("c", 3), ("d", 4)], Signature.of(gapped))
    assert bound.call() == ((1,), {"c": 3, "d": 4})
    assert call_of(bound, gapped) == (1, 0, 3, 4)

    def positional_only(a, b=0, /, c=0):
        return a, b, c

    with pytest.raises(CannotCall, match="by position only"):
        bind_call([("b", 2)], Signature.of(lambda a=0, b=0, /: None))
    assert call_of(bind_call([("0", 1), ("c", 3)], Signature.of(positional_only)),
                   positional_only) == (1, 0, 3)


def test_the_mapping_drops_arguments_named_with_an_empty_port_name():
    args = {"past_key_values": "", "1": "mask"}
    assert dropped_arguments(args) == {"past_key_values"}
    assert map_argument("past_key_values.0", args) == "past_key_values.0"  # no rename
    assert map_argument("1", args) == "mask"
    assert map_argument("1.0", args) == "mask.0"


def test_parameter_describes_itself():
    assert Parameter("eps", "positional", True, "1e-05").describe() == "eps=1e-05"
    assert Parameter("kw", "var_keyword", False, None).describe() == "**kw"


# ---- replay end to end
class HFAttention(nn.Module):
    """Called the way Hugging Face calls its attention: everything by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False, **kwargs):
        h = self.proj(hidden_states)
        return h if attention_mask is None else h * attention_mask


class PortAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class Net(nn.Module):
    def __init__(self, attn: nn.Module, masked: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.head = nn.Linear(8, 3)
        self.masked = masked

    def forward(self, x, mask):
        if isinstance(self.attn, PortAttention):
            h = self.attn(x)
        else:
            h = self.attn(hidden_states=x, attention_mask=mask if self.masked else None,
                          output_attentions=False, past_key_values=None)
        return self.head(torch.tanh(h))


def _case(attn: nn.Module, masked: bool = False) -> Case:
    torch.manual_seed(0)
    model = Net(attn, masked)
    x, mask = torch.randn(4, 8), (torch.rand(4, 8) > 0.3).float()
    y = torch.arange(4) % 3
    return Case(model=model, inputs=(x, mask),
                loss_fn=lambda out: nn.functional.cross_entropy(out, y), name="tests:calling")


def test_capture_records_each_module_types_forward_signature(tmp_path):
    path = capture(_case(HFAttention()), tmp_path / "ref.h5")
    with open_trace(path) as trace:
        signature = Signature.from_json(trace.meta["signatures"]["HFAttention"])
    assert signature.describe() == ("HFAttention.forward(hidden_states, attention_mask=None, "
                                    "output_attentions=False, **kwargs)")


def test_replay_drops_hugging_face_keywords_the_port_does_not_take(tmp_path):
    ref = capture(_case(HFAttention()), tmp_path / "ref.h5")
    result = replay(ref, _case(PortAttention()), propagated=False)
    failed, replayed, dropped = replay_outcome(result)
    assert not failed and "attn#0" in replayed
    assert dropped["attn#0"] == [("attention_mask", "None"),
                                 ("output_attentions", "its default false"),
                                 ("past_key_values", "None")]
    rows = result.diff.rows
    rows = rows[(rows["port_site"] == "attn#0") & (rows["role"] == "output")]
    assert len(rows) == 1 and (rows["ratio"] <= 1).all() and result.passed


def test_replay_judges_a_layer_whose_tensor_argument_the_port_does_not_take(tmp_path):
    """The reference's attention gets a float mask the port has no parameter for: the port's
    attention is called without it, the mask is listed as not taken, and the layer is judged
    on what it computed (the port applies no mask, so its output is out of tolerance: its own
    error, found locally)."""
    ref = capture(_case(HFAttention(), masked=True), tmp_path / "ref.h5")
    result = replay(ref, _case(PortAttention()), propagated=False)
    failed, replayed, dropped = replay_outcome(result)
    assert not failed and {"attn#0", "head#0"} <= replayed
    assert ("attention_mask", "float32 (4,8)") in dropped["attn#0"]
    local = result.local
    row = local[(local["port_site"] == "attn#0") & (local["pass"] == "forward")].iloc[0]
    assert row["verdict"] == "LOCAL ERROR" and result.outcome == "fail"
    # the mask is no input of the port's layer: not recorded for it, not missing in the diff
    rows = result.diff.rows
    assert not ((rows["port_site"] == "attn#0") & (rows["arg"] == "attention_mask")).any()
    assert "cannot-judge" not in set(rows["status"])
