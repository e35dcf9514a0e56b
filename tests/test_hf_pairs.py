"""Real third-party pairs: Hugging Face's LlamaForCausalLM against a Meta-style port
(reference_models/hf_llama.py, llama_port.py, hf_llama_convert.py, hf_llama.map.toml), and
Hugging Face's GPT2LMHeadModel against nanoGPT (reference_models/hf_gpt2.py against
tests/gpt_cases.py, hf_gpt2.map.toml). Tiny random configs, no downloads; skipped without
transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from layerdiff.cli import main  # noqa: E402
from layerdiff.report.findings.diff import describe_origin  # noqa: E402
from reference_models import hf_gpt2, hf_llama, llama_port  # noqa: E402
from reference_models import hf_llama_convert as convert  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MAP = ROOT / "reference_models" / "hf_llama.map.toml"
GPT2_MAP = ROOT / "reference_models" / "hf_gpt2.map.toml"
LOSS_SCALE = 2**20


# ---- the pair itself, checked directly (no layerdiff): what every other test stands on
def _converted_port(port_case, reference_model: torch.nn.Module) -> torch.nn.Module:
    """The port with the reference's weights, q/k rows permuted, copied by hand."""
    hf = dict(reference_model.named_parameters())
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    parts = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for layer in range(hf_llama.CONFIG.n_layers):
        for port_name, hf_name in parts.items():
            names[f"layers.{layer}.{port_name}.weight"] = f"model.layers.{layer}.{hf_name}.weight"
    with torch.no_grad():
        for name, param in port_case.model.named_parameters():
            tensor = hf[names[name]]
            if name.endswith(("wq.weight", "wk.weight")):
                tensor = convert.hf_to_meta_qk(tensor)
            param.copy_(tensor)
    return port_case.model


@pytest.fixture(scope="module")
def llama_pair():
    reference = hf_llama.reference()
    port = _converted_port(llama_port.port(), reference.model)
    return reference, port


def test_port_reproduces_hf_logits_after_the_rope_permutation(llama_pair):
    reference, port = llama_pair
    tokens = reference.inputs["input_ids"]
    with torch.no_grad():
        expected = reference.model(input_ids=tokens).logits
        got = port(tokens)
    assert got.shape == expected.shape == (4, 16, 128)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_without_the_permutation_the_port_computes_something_else(llama_pair):
    reference, _ = llama_pair
    port = _converted_port(llama_port.port(), reference.model)
    hf = dict(reference.model.named_parameters())
    with torch.no_grad():
        for layer in range(hf_llama.CONFIG.n_layers):  # HF's q/k rows as they are
            attention = port.layers[layer].attention
            attention.wq.weight.copy_(hf[f"model.layers.{layer}.self_attn.q_proj.weight"])
            attention.wk.weight.copy_(hf[f"model.layers.{layer}.self_attn.k_proj.weight"])
        tokens = reference.inputs["input_ids"]
        error = (port(tokens) - reference.model(input_ids=tokens).logits).abs().max()
    assert error > 1e-3


def test_permutation_interleaves_each_heads_halves_and_inverts():
    head_dim = convert.HEAD_DIM
    rows = torch.arange(2 * head_dim, dtype=torch.float32)[:, None].expand(-1, 3)  # 2 heads
    meta = convert.hf_to_meta_qk(rows)
    for head in range(2):
        for i in range(head_dim // 2):
            assert meta[head * head_dim + 2 * i, 0] == head * head_dim + i
            assert meta[head * head_dim + 2 * i + 1, 0] == head * head_dim + i + head_dim // 2
    assert torch.equal(convert.meta_to_hf_qk(meta), rows)
    with pytest.raises(ValueError, match="whole heads"):
        convert.hf_to_meta_qk(torch.zeros(head_dim + 1, 4))


def _record_call(module: torch.nn.Module, run) -> tuple[tuple, dict, object]:
    """The args, kwargs and output of ``module``'s first call while ``run()`` runs."""
    seen: dict = {}

    def pre(_module, args, kwargs):
        seen.setdefault("call", (args, dict(kwargs)))

    def post(_module, _args, _kwargs, output):
        seen.setdefault("output", output)

    handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
               module.register_forward_hook(post, with_kwargs=True)]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return (*seen["call"], seen["output"])


@pytest.mark.parametrize("layer", [0, 1])
def test_call_adapters_turn_hf_calls_into_the_ports(llama_pair, layer):
    reference, port = llama_pair
    run = lambda: reference.model(**reference.inputs)  # noqa: E731
    hf_layer = reference.model.model.layers[layer]
    args, kwargs, output = _record_call(hf_layer.self_attn, run)
    assert "position_embeddings" in kwargs and "hidden_states" in kwargs  # HF's call, by keyword
    port_args, port_kwargs = convert.attention_call(*args, **kwargs)
    assert [tuple(a.shape) for a in port_args[1:]] == [(16, convert.HEAD_DIM // 2)] * 2
    with torch.no_grad():
        got = port.layers[layer].attention(*port_args, **port_kwargs)
    torch.testing.assert_close(got, output[0], rtol=1e-5, atol=1e-6)

    args, kwargs, output = _record_call(hf_layer, run)
    port_args, port_kwargs = convert.block_call(*args, **kwargs)
    with torch.no_grad():
        got = port.layers[layer](*port_args, **port_kwargs)
    torch.testing.assert_close(got, output, rtol=1e-5, atol=1e-6)


def test_adapter_refuses_a_call_without_rotary_tables():
    with pytest.raises(ValueError, match="position_embeddings"):
        convert.attention_call(torch.zeros(1, 4, 64), attention_mask=None)


@pytest.mark.parametrize("bug", ["port_bug_attention", "port_bug_mlp", "port_bug_norm",
                                 "port_bug_rotary"])
def test_each_planted_bug_changes_the_logits(llama_pair, bug):
    reference, port = llama_pair
    buggy = getattr(llama_port, bug)()
    buggy.model.load_state_dict(port.state_dict())
    tokens = reference.inputs["input_ids"]
    with torch.no_grad():
        error = (buggy.model(tokens) - port(tokens)).abs().max()
    assert error > 1e-4, f"{bug} changes nothing"


def test_gpt2_port_reproduces_hf_gpt2_with_transposed_conv1d_weights():
    from tests import gpt_cases

    reference, port = hf_gpt2.reference(), gpt_cases.port()
    hf = dict(reference.model.named_parameters())
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")
    with torch.no_grad():
        for name, param in port.model.named_parameters():
            source = name if name in hf else name.replace("lm_head", "transformer.wte")
            param.copy_(hf[source].T if name.endswith(transposed) else hf[source])
        tokens = reference.inputs["input_ids"]
        assert torch.equal(tokens, port.inputs[0])  # the same batch
        expected = reference.model(input_ids=tokens).logits
        torch.testing.assert_close(port.model(tokens)[0], expected, rtol=1e-5, atol=1e-6)


def test_mappings_name_only_functions_that_exist():
    import importlib
    import tomllib

    named = []
    for path in (LLAMA_MAP, GPT2_MAP):
        data = tomllib.loads(path.read_text())
        for rule in data.get("param", []):
            chain = rule.get("transform", [])
            named += [step for step in ([chain] if isinstance(chain, str) else chain)
                      if ":" in step]
        named += [rule["call"] for rule in data.get("site", []) if "call" in rule]
    assert len(named) == 4  # hf_to_meta_qk twice, attention_call, block_call
    for spec in named:
        module, _, name = spec.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), spec


# ---- what layerdiff makes of the pairs
def _cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code in (0, 1), f"layerdiff {' '.join(map(str, args))}:\n{result.output}"
    return result.output


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """``get(spec, weights_from=None, mapping=None)``: a trace captured once per module."""
    folder = tmp_path_factory.mktemp("hf_pairs")
    cache: dict[tuple, Path] = {}

    def get(spec: str, weights_from: Path | None = None, mapping: Path | None = None) -> Path:
        key = (spec, weights_from, mapping)
        if key not in cache:
            path = folder / f"{len(cache)}.h5"
            extra = ["--weights-from", weights_from, "--map", mapping] if weights_from else []
            result = CliRunner().invoke(main, [str(a) for a in (
                "capture", spec, "-o", path, "--loss-scale", LOSS_SCALE, *extra)])
            assert result.exit_code == 0, result.output
            cache[key] = path
        return cache[key]

    return get


def _json_of(tmp_path: Path, *args) -> dict:
    out = tmp_path / f"{args[0]}.json"
    _cli(*args, "--json", out)
    return json.loads(out.read_text())


def test_sdpa_reference_records_no_attention_weights_and_no_mask(traces):
    from layerdiff import open_trace

    def tensors(spec: str, role: str) -> set[str]:
        index = open_trace(traces(spec)).index
        rows = index[(index["site"] == "model.layers.0.self_attn#0") & (index["role"] == role)
                     & (index["kind"] == "tensor")]
        return set(rows["arg"])

    eager, sdpa = "reference_models.hf_llama:reference", "reference_models.hf_llama:reference_sdpa"
    # eager: (output, attn_weights), a 4-D additive mask in
    assert tensors(eager, "output") == {"0", "1"}
    assert "attention_mask" in tensors(eager, "input")
    # sdpa: (output, None), and no mask at all (SDPA's is_causal does the masking)
    assert tensors(sdpa, "output") == tensors(sdpa, "grad_output") == {"0"}
    assert "attention_mask" not in tensors(sdpa, "input")


def test_eager_attention_weights_get_no_gradient_record(traces):
    """The decoder layer throws the weights away: no gradient arrives at them from outside."""
    from layerdiff import open_trace

    index = open_trace(traces("reference_models.hf_llama:reference")).index
    rows = index[(index["site"] == "model.layers.0.self_attn#0")
                 & (index["role"] == "grad_output") & (index["kind"] == "tensor")]
    assert set(rows["arg"]) == {"0"}


def test_sdpa_and_eager_references_compute_the_same_logits():
    eager, sdpa = hf_llama.reference(), hf_llama.reference_sdpa()
    with torch.no_grad():
        torch.testing.assert_close(sdpa.model(**sdpa.inputs).logits,
                                   eager.model(**eager.inputs).logits, rtol=1e-5, atol=1e-6)


def test_llama_mapping_loads_and_map_check_passes(traces, tmp_path):
    from layerdiff import Mapping

    Mapping.load(LLAMA_MAP)
    reference = traces("reference_models.hf_llama:reference")
    result = _json_of(tmp_path, "map-check", reference, "reference_models.llama_port:port",
                      "--map", LLAMA_MAP)
    assert result["verdict"] == "pass", result


@pytest.mark.parametrize("reference_spec", ["reference_models.hf_llama:reference",
                                            "reference_models.hf_llama:reference_sdpa"])
def test_faithful_llama_port_passes(traces, reference_spec):
    from layerdiff import diff

    reference = traces(reference_spec)
    port = traces("reference_models.llama_port:port", reference, LLAMA_MAP)
    result = diff(reference, port, mapping=LLAMA_MAP)
    assert result, [describe_origin(origin) for origin in result.origins]


LLAMA_BUGS = [("port_bug_attention", "layers.1.attention#0"),
              ("port_bug_mlp", "layers.0.feed_forward#0"),
              ("port_bug_norm", "layers.1.ffn_norm#0"),
              ("port_bug_rotary", "layers.0.attention#0")]


@pytest.mark.parametrize(("bug", "port_site"), LLAMA_BUGS)
def test_llama_bug_is_named_at_its_layer_forward(traces, bug, port_site):
    from layerdiff import diff

    reference = traces("reference_models.hf_llama:reference")
    port = traces(f"reference_models.llama_port:{bug}", reference, LLAMA_MAP)
    result = diff(reference, port, mapping=LLAMA_MAP)
    assert not result
    origin = result.origin
    assert (origin.port_site, origin.pass_) == (port_site, "forward"), describe_origin(origin)
    block = port_site.split(".")[0] + "." + port_site.split(".")[1] + "#0"  # layers.N#0
    assert all(o.port_site != block for o in result.origins), [describe_origin(o)
                                                               for o in result.origins]


def test_faithful_gpt2_port_passes(traces):
    from layerdiff import diff

    reference = traces("reference_models.hf_gpt2:reference")
    port = traces("tests.gpt_cases:port", reference, GPT2_MAP)
    result = diff(reference, port, mapping=GPT2_MAP)
    assert result, [describe_origin(origin) for origin in result.origins]


@pytest.mark.parametrize("bug", ["port_bug_attn_scale", "port_bug_causal_mask"])
def test_gpt2_attention_bug_is_named_at_the_attention(traces, bug):
    from layerdiff import diff

    reference = traces("reference_models.hf_gpt2:reference")
    port = traces(f"tests.gpt_cases:{bug}", reference, GPT2_MAP)
    result = diff(reference, port, mapping=GPT2_MAP)
    assert not result
    assert (result.origin.port_site, result.origin.pass_) == (
        "transformer.h.0.attn#0", "forward"), describe_origin(result.origin)


def test_gpt2_replay_names_the_attention_without_drop_rules(traces, tmp_path):
    reference = traces("reference_models.hf_gpt2:reference")
    result = _json_of(tmp_path, "replay", reference, "tests.gpt_cases:port_bug_attn_scale",
                      "--map", GPT2_MAP)
    assert result["replay"]["cannot_judge"] == []
    assert result["origin"]["port_site"] == "transformer.h.0.attn#0"


def test_llama_replay_judges_the_attention_through_the_adapter(traces, tmp_path):
    reference = traces("reference_models.hf_llama:reference")
    result = _json_of(tmp_path, "replay", reference,
                      "reference_models.llama_port:port_bug_attention", "--map", LLAMA_MAP)
    assert result["replay"]["cannot_judge"] == [], result["replay"]["cannot_judge"]
    assert (result["origin"]["port_site"], result["origin"]["pass"]) == (
        "layers.1.attention#0", "forward")


@pytest.mark.parametrize(("port_case", "outcome"), [("port_bug_attention", "breaks"),
                                                    ("port", "within")])
def test_llama_swap_judges_the_attention_through_the_adapter(tmp_path, port_case, outcome):
    result = _json_of(tmp_path, "swap", "reference_models.hf_llama:reference",
                      f"reference_models.llama_port:{port_case}", "--map", LLAMA_MAP,
                      "--site", "layers.1.attention")
    assert result["outcome"] == outcome, result


def test_llama_bisect_finds_the_attention(tmp_path):
    result = _json_of(tmp_path, "bisect", "reference_models.hf_llama:reference",
                      "reference_models.llama_port:port_bug_attention", "--map", LLAMA_MAP)
    assert result["outcome"] == "culprits", result
    assert [c["port"] for c in result["culprits"]] == ["layers.1.attention"]
