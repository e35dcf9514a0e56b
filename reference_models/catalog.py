"""The list of bundled cases that `layerdiff cases` prints: what each is and, for a planted bug,
where it lives. Scripts drive every bundled case from the JSON form of this list."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class CaseInfo:
    spec: str                      # package.module:name, for `layerdiff capture`
    model: str                     # mlp | cnn | transformer | convlstm | causal_lm | bench | ...
    kind: str                      # reference | port | bug | diagnostic (for a debug command)
    description: str
    reference: str | None = None   # for a port or a bug: the case it should match
    mapping: str | None = None     # the mapping file it needs (beside this file), if any
    site: str | None = None        # for a bug: the site (in the port's names) where it lives
    pass_: str | None = None       # for a bug: forward | backward
    # for a bug: the port sites whose code holds it (a glob), where replay finds local error
    runs_in: str | None = None
    # for a bug in a module's own code: the op site where a capture with --ops names it
    op_site: str | None = None
    # ranks to capture the case with (`capture --nproc N`); such cases are in MULTI_RANK, not
    # CATALOG, which the one-process suites walk
    nproc: int = 1

    @property
    def mapping_path(self) -> Path | None:
        return HERE / self.mapping if self.mapping else None

    def as_json(self) -> dict:
        data = asdict(self)
        data["pass"] = data.pop("pass_")
        del data["runs_in"]
        data["mapping"] = str(self.mapping_path) if self.mapping else None
        return data


def _ref(model: str, description: str) -> CaseInfo:
    return CaseInfo(f"reference_models.{model}:reference", model, "reference", description)


def _mapping(module: str) -> str | None:
    name = f"{module}.map.toml"
    return name if (HERE / name).exists() else None


def _port(module: str, name: str, model: str, description: str) -> CaseInfo:
    return CaseInfo(f"reference_models.{module}:{name}", model, "port", description,
                    reference=f"reference_models.{model}:reference", mapping=_mapping(module))


def _bug(module: str, name: str, model: str, site: str, pass_: str, description: str,
         runs_in: str | None = None) -> CaseInfo:
    return CaseInfo(f"reference_models.{module}:{name}", model, "bug", description,
                    reference=f"reference_models.{model}:reference", mapping=_mapping(module),
                    site=site, pass_=pass_, runs_in=runs_in or site)


_HINTS = "reference_models.hint_bugs"
_OPS = "reference_models.op_bugs"
_PAIRING = "reference_models.op_pairing"


def _hint_bug(name: str, model: str, site: str, pass_: str, description: str, *,
              runs_in: str | None = None, mapping: str | None = None,
              reference: str | None = None) -> CaseInfo:
    return CaseInfo(f"{_HINTS}:{name}", model, "bug", description,
                    reference=reference or f"reference_models.{model}:reference", mapping=mapping,
                    site=site, pass_=pass_, runs_in=runs_in or site)


def find(spec: str) -> CaseInfo | None:
    """The catalog entry of a bundled case spec."""
    return next((info for info in CATALOG + MULTI_RANK + FLAX if info.spec == spec), None)


CATALOG: list[CaseInfo] = [
    _ref("mlp", "MLP classifier: Linear, in-place ReLU, dropout, GELU; cross-entropy"),
    _ref("cnn", "residual CNN: convolutions, batch norm (training mode), max pooling, a "
                "residual block, global average pooling; cross-entropy"),
    _ref("transformer", "encoder-decoder translation transformer (Attention Is All You Need "
                        "style), 2+2 layers, d_model 64; NLL loss"),
    _ref("convlstm", "ConvLSTM next-frame predictor over 6 frames; MSE loss, 3 SGD steps with "
                     "gradient clipping"),
    CaseInfo("reference_models.transformer:reference_large", "transformer", "reference",
             "the transformer at benchmark size: d_model 256, 4+4 layers, length 128"),
    CaseInfo("reference_models.bench:deep_narrow", "bench", "reference",
             "120 Linear+ReLU blocks on small activations: ~1,450 tensors a step"),

    _port("mlp_port", "port", "mlp", "explicit matrix products, clamp ReLU, erf GELU; same names"),
    _port("cnn_port", "port", "cnn", "hand-written batch norm, mean pooling, a custom autograd "
                                     "ReLU in the residual block; same names"),
    _port("transformer_port", "port", "transformer",
          "independent implementation: fused QKV, scaled_dot_product_attention, other module "
          "names and structure (names mapped by transformer_port.map.toml)"),
    _port("transformer_port", "port_manual", "transformer",
          "the transformer port with its attention kernel written out by hand"),
    _port("convlstm_numpy", "port", "convlstm",
          "pure numpy, forward and backward by hand; records itself with TraceWriter"),

    _bug("mlp_port", "bug_weight_not_transposed", "mlp", "fc2#0", "forward",
         "a square Linear weight used without its transpose (x @ W instead of x @ W.T)"),
    _bug("mlp_port", "bug_gelu_tanh", "mlp", "act2#0", "forward",
         "GELU from its tanh approximation where the reference uses erf: at most ~5e-4 apart, "
         "outside float32 tolerance, inside bfloat16 rounding"),
    _bug("cnn_port", "bug_relu_backward_batch", "cnn", "block.act#0", "backward",
         "custom autograd ReLU whose backward applies the first batch element's mask to "
         "all: gradients wrong only for batch elements after the first"),
    _bug("transformer_port", "bug_softmax_axis", "transformer", "enc.0.self_attn#0", "forward",
         "attention softmax over the query axis instead of the key axis", "*_attn#0"),
    _bug("transformer_port", "bug_head_split_reshape", "transformer", "enc.0.self_attn#0",
         "forward", "heads split with reshape instead of permute: mixes batch elements",
         "*_attn#0"),
    _bug("transformer_port", "bug_missing_scale", "transformer", "enc.0.self_attn#0", "forward",
         "attention scores not scaled by 1/sqrt(d_k)", "*_attn#0"),
    _bug("transformer_port", "bug_layernorm_eps", "transformer", "enc.0.ln1#0", "forward",
         "layer norms with epsilon 1e-3 (Keras's default) instead of 1e-5: out of tolerance. "
         "Flax's 1e-6 stays inside float32 tolerance and is not a bug here", "*.ln*#0"),
    _bug("transformer_port", "bug_inverted_mask", "transformer", "enc.0.self_attn#0", "forward",
         "attention mask inverted: attends to padding and future tokens only", "*_attn#0"),
    _bug("convlstm_numpy", "bug_accumulator_not_zeroed", "convlstm", "cell.conv#4", "backward",
         "numpy col2im accumulator reused without zeroing (np.empty semantics): wrong from "
         "the second frame of the backward on", "cell.conv#*"),

    # planted bugs for the likely-cause hints the zoo lacked (reference_models/hint_bugs.py)
    CaseInfo(f"{_HINTS}:causal_reference", "causal_lm", "reference",
             "small causal language model: embedding, one pre-norm block with GPT-style "
             "attention whose kernel is a module of its own (attn.core), linear head"),
    CaseInfo(f"{_HINTS}:causal_port", "causal_lm", "port",
             "the causal language model with its attention kernel from "
             "scaled_dot_product_attention(is_causal=True)",
             reference=f"{_HINTS}:causal_reference"),
    _hint_bug("mlp_sign_backward", "mlp", "act1#0", "backward",
              "ReLU with a hand-written backward whose sign is flipped"),
    _hint_bug("mlp_bias_twice", "mlp", "fc2#0", "forward",
              "a Linear layer that adds its bias twice (in F.linear and by hand)"),
    _hint_bug("mlp_bf16_layer", "mlp", "fc1#0", "forward",
              "one Linear layer computed in bfloat16 and cast back to float32"),
    _hint_bug("cnn_sum_pool", "cnn", "gap#0", "forward",
              "global pooling sums where the reference averages"),
    _hint_bug("cnn_batchnorm_eps", "cnn", "block.bn1#0", "forward",
              "a batch norm with epsilon 1e-3 instead of 1e-5"),
    _hint_bug("convlstm_gate_order", "convlstm", "cell.conv#0", "forward",
              "numpy ConvLSTM whose gate convolution writes the gates in (i, f, o, g) order "
              "while the cell splits them as (i, f, g, o)", runs_in="cell*"),
    _hint_bug("transformer_mask_ignored", "transformer", "enc.0.self_attn#0", "forward",
              "the attention kernel is never given the padding mask", runs_in="*_attn#0",
              mapping="transformer_port.map.toml"),
    _hint_bug("causal_mask_off_by_one", "causal_lm", "attn.core#0", "forward",
              "causal mask made with tril(diagonal=1): each position sees the next token",
              reference=f"{_HINTS}:causal_reference"),
    _hint_bug("causal_heads_merged_by_reshape", "causal_lm", "attn.core#0", "forward",
              "attention heads merged with a reshape where transpose + reshape belonged",
              reference=f"{_HINTS}:causal_reference"),

    CaseInfo(f"{_OPS}:reference", "op_lm", "reference",
             "small GPT-style language model whose attention (explicit ops: matmul, scale, "
             "masked_fill with a causal buffer, softmax) and squared-ReLU MLP (a custom autograd "
             "function) compute in their modules' own code; 2 blocks, 2 SGD steps"),
    CaseInfo(f"{_OPS}:port", "op_lm", "port",
             "the op-level language model with attention from scaled_dot_product_attention "
             "(is_causal=True) and its own SquaredReLU function; same names",
             reference=f"{_OPS}:reference"),
    CaseInfo(f"{_OPS}:bug_softmax_axis", "op_lm", "bug",
             "block 0's attention softmax over the query axis, in the attention module's own "
             "code", reference=f"{_OPS}:reference", site="blocks.0.attn#0", pass_="forward",
             runs_in="blocks.0.attn#0", op_site="blocks.0.attn#0/softmax#0"),
    CaseInfo(f"{_OPS}:bug_scale_1_over_d", "op_lm", "bug",
             "block 0's attention scores scaled by 1/d_head instead of 1/sqrt(d_head), in the "
             "attention module's own code", reference=f"{_OPS}:reference",
             site="blocks.0.attn#0", pass_="forward", runs_in="blocks.0.attn#0",
             op_site="blocks.0.attn#0/mul#0"),
    CaseInfo(f"{_OPS}:bug_custom_backward", "op_lm", "bug",
             "block 1's custom autograd SquaredReLU whose backward drops the factor 2 for every "
             "batch element but the first", reference=f"{_OPS}:reference",
             site="blocks.1.mlp#0", pass_="backward", runs_in="blocks.1.mlp#0",
             op_site="blocks.1.mlp#0/SquaredReLU#0"),
    CaseInfo(f"{_PAIRING}:custom_softmax_port", "op_lm", "port",
             "the op-level language model with its attention softmax from a custom autograd "
             "function (MySoftmax, backward by hand): an op of another name, paired by position",
             reference=f"{_OPS}:reference"),
    CaseInfo(f"{_PAIRING}:bug_custom_softmax_backward", "op_lm", "bug",
             "block 1's custom MySoftmax whose backward returns y * g (the Jacobian's diagonal "
             "only); its forward is exact", reference=f"{_OPS}:reference",
             site="blocks.1.attn#0", pass_="backward", runs_in="blocks.1.attn#0",
             op_site="blocks.1.attn#0/softmax#0"),
    CaseInfo(f"{_PAIRING}:fused_softmax_port", "op_lm", "port",
             "the op-level language model with scale, causal mask and softmax in one fused "
             "autograd function: one op for three, paired as a group",
             reference=f"{_OPS}:reference"),
    CaseInfo(f"{_PAIRING}:bug_fused_softmax_backward", "op_lm", "bug",
             "block 1's fused scale-mask-softmax whose backward forgets the scale; its forward "
             "is exact", reference=f"{_OPS}:reference", site="blocks.1.attn#0",
             pass_="backward", runs_in="blocks.1.attn#0", op_site="blocks.1.attn#0/mul#0"),

    CaseInfo("reference_models.batch_mixing:reference", "attention", "reference",
             "attention classifier: batch-first data through a sequence-first "
             "nn.MultiheadAttention (transpose); batch 6"),
    CaseInfo("reference_models.schedule_port:reference", "schedule", "reference",
             "the MLP over 6 SGD steps, learning rate 0.1 then 0.01 from step 3"),
    CaseInfo("reference_models.schedule_port:port", "schedule", "port",
             "the MLP port with the same schedule",
             reference="reference_models.schedule_port:reference"),

    # cases for the debugging commands: not ports of a reference, each with the fault the
    # command finds (site and pass in the case's own names)
    CaseInfo("reference_models.numerics:nan_log_softmax", "numerics", "diagnostic",
             "raw 0-255 pixels into log(softmax(x)): softmax underflows to 0, -inf in the "
             "forward (layerdiff nan)", site="log_probs#0", pass_="forward"),
    CaseInfo("reference_models.numerics:nan_sqrt_backward", "numerics", "diagnostic",
             "where(x > 0, sqrt(x), 0): a finite forward, a NaN gradient (layerdiff nan)",
             site="features.sqrt#0", pass_="backward"),
    CaseInfo("reference_models.numerics:convlstm_uninitialised_bias", "convlstm", "diagnostic",
             "numpy ConvLSTM whose bias-gradient accumulator is never zeroed, its first contents "
             "from os.urandom: differs from run to run (layerdiff determinism)",
             site="cell.conv#0", pass_="backward"),
    CaseInfo("reference_models.batch_mixing:bug_reshape_seq_first", "attention", "diagnostic",
             "batch-first to sequence-first with reshape instead of transpose: mixes samples "
             "(layerdiff batch-independence)", reference="reference_models.batch_mixing:reference",
             site="blocks.0.attn#0", pass_="forward"),
    CaseInfo("reference_models.schedule_port:bug_schedule_early", "schedule", "diagnostic",
             "learning-rate schedule one step early (scheduler stepped before the optimizer): "
             "weights differ from step 3 (layerdiff diverge)",
             reference="reference_models.schedule_port:reference", site="fc1#0",
             pass_="forward"),
]

_TP = "reference_models.tensor_parallel"
CATALOG.append(CaseInfo(
    "reference_models.flax_mlp_reference:reference", "prenorm_mlp", "reference",
    "pre-norm residual MLP classifier (Linear with GPT-2's 0.02 init, LayerNorm, square "
    "Linear, erf GELU, Linear, final LayerNorm, head): the torch reference of the Flax NNX port "
    "reference_models.flax_mlp; cross-entropy, SGD with momentum"))
CATALOG.append(_ref("tensor_parallel", "GPT-style causal LM (two pre-norm blocks, GELU MLP with "
                                       "dropout); next-token cross-entropy, 2 SGD steps"))

# Multi-rank ports: captured with `--nproc 2` (gloo), diffed with their shard rules.
MULTI_RANK: list[CaseInfo] = [
    CaseInfo(f"{_TP}:port", "tensor_parallel", "port",
             "Megatron tensor-parallel port: column-parallel fc, row-parallel proj, all-reduce "
             "functions f and g", reference=f"{_TP}:reference",
             mapping="tensor_parallel.map.toml", nproc=2),
    CaseInfo(f"{_TP}:bug_bias_before_allreduce", "tensor_parallel", "bug",
             "the row-parallel proj adds its bias on every rank before the all-reduce: it counts "
             "world-size times", reference=f"{_TP}:reference", mapping="tensor_parallel.map.toml",
             site="blocks.0.mlp.proj#0", pass_="forward", runs_in="blocks.0.mlp.proj", nproc=2),
    CaseInfo(f"{_TP}:bug_dropout_per_rank", "tensor_parallel", "bug",
             "dropout seeded with seed + rank on a replicated tensor: replicas disagree (found "
             "by layerdiff ranks; rank 0 matches the reference)", reference=f"{_TP}:reference",
             mapping="tensor_parallel.map.toml", site="blocks.0.mlp.dropout#0",
             pass_="forward", runs_in="blocks.0.mlp.dropout", nproc=2),
]

# Flax NNX ports (need the `jax` extra): a list of their own, as the one-process suites that walk
# CATALOG capture, swap and load torch weights into every port there. Each holds the
# reference's weights already; `capture --weights-from REF --map` with the entry's mapping
# loads them the same way.
_FLAX = "reference_models.flax_mlp"
_FLAX_REF = "reference_models.flax_mlp_reference:reference"


def _flax(name: str, kind: str, description: str, site: str | None = None,
          pass_: str | None = None, runs_in: str | None = None,
          mapping: str = "flax_mlp.map.toml") -> CaseInfo:
    return CaseInfo(f"{_FLAX}:{name}", "prenorm_mlp", kind, description, reference=_FLAX_REF,
                    mapping=mapping, site=site, pass_=pass_, runs_in=runs_in or site)


FLAX: list[CaseInfo] = [
    _flax("port", "port", "Flax NNX port: nnx.Linear kernels (in, out), nnx.LayerNorm with "
          "torch's epsilon 1e-5 and two-pass variance, exact GELU; same module names"),
    _flax("bug_layernorm_eps", "bug", "nnx.LayerNorm's default epsilon 1e-6 where torch's is "
          "1e-5: out of float32 tolerance where the LayerNorm's input has small variance "
          "(here ~0.01, from GPT-2's 0.02 init)", "block.ln#0", "forward", "*ln*#0"),
    _flax("bug_gelu_tanh", "bug", "jax.nn.gelu's default approximate=True (tanh) where "
          "torch.nn.GELU is exact (erf)", "block.act#0", "forward"),
    _flax("bug_kernel_not_transposed", "bug", "block.fc1's (square) torch weight loaded as its "
          "kernel without the transpose: the mapping file flax_mlp_untransposed.map.toml "
          "leaves out transform = \"transpose\"", "block.fc1#0", "forward",
          mapping="flax_mlp_untransposed.map.toml"),
]
