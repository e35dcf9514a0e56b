"""Cases of the mixture-of-experts validation pair, and the code its mapping names.

``reference``: transformers' ``MixtralForCausalLM`` (``moe_hf.py``) with its own loss (labels;
no router aux loss: ``output_router_logits`` is False). ``port``: the gpt-fast-style
``moe_gptfast.Transformer`` with the same next-token loss on its logits. The bugs are planted
here, one place each, without editing either model file:

- ``port_bug_expert``: layer 0's experts, expert 2's w3 branch goes through silu;
- ``port_bug_renorm``: layer 1's MoE block does not renormalise its top-k weights;
- ``port_bug_rope``: layer 0's attention rotates the wrong way (sin negated);
- ``port_bug_eps``: layer 1's attention_norm has epsilon 1e-3 (1e-5 wanted);
- ``port_bug_backward``: layer 0's ffn_norm is a custom autograd function whose backward drops
  the normaliser's own derivative (its forward is right).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch.nn import functional as F

from layerdiff import Case, seed_everything
from tests.validation import moe_gptfast as G
from tests.validation import moe_hf as H

BATCH, SEQ = 2, 10
HEAD_DIM = H.DIM // H.HEADS


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    seed_everything(H.SEED + 1)
    ids = torch.randint(H.VOCAB, (BATCH, SEQ + 1))
    return ids[:, :-1], ids[:, :-1].clone()  # HF shifts the labels itself


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def reference() -> Case:
    ids, labels = _batch()
    return Case(model=H.mixtral().train(),
                inputs={"input_ids": ids, "labels": labels, "use_cache": False},
                loss_fn=lambda out: out.loss, seed=H.SEED, steps=1, optimizer=_sgd,
                name="tests.validation.moe_cases:reference")


def _port_model() -> G.Transformer:
    config = G.ModelArgs(block_size=H.MAX_POS, vocab_size=H.VOCAB, n_layer=H.LAYERS,
                         n_head=H.HEADS, dim=H.DIM, intermediate_size=H.FFN,
                         n_local_heads=H.KV_HEADS, norm_eps=H.EPS, num_experts=H.EXPERTS,
                         num_activated_experts=H.TOP_K)
    seed_everything(H.SEED)
    model = G.Transformer(config)
    with torch.no_grad():  # its own init (the weights come from the reference's trace)
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.setup_caches(H.MAX_POS)
    return model.train()


def _case(model: G.Transformer, name: str) -> Case:
    ids, labels = _batch()

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, H.VOCAB).float(),
                               labels[:, 1:].reshape(-1))

    return Case(model=model, inputs=(ids, torch.arange(SEQ)), loss_fn=loss_fn, seed=H.SEED,
                steps=1, optimizer=_sgd, name=f"tests.validation.moe_cases:{name}")


def port() -> Case:
    return _case(_port_model(), "port")


# ---------------------------------------------------------------- the mapping's code

def wqkv_rows(w: torch.Tensor) -> torch.Tensor:
    """HF's q, k, v rows stacked -> the port's wqkv: q's and k's rows from rotate-half order
    to interleaved pairs within each head; v's rows as they are."""
    q, k = H.HEADS * HEAD_DIM, H.KV_HEADS * HEAD_DIM
    parts = []
    for rows in (w[:q], w[q:q + k]):
        heads = rows.shape[0] // HEAD_DIM
        parts.append(rows.reshape(heads, 2, HEAD_DIM // 2, *rows.shape[1:]).transpose(1, 2)
                     .reshape(rows.shape))
    return torch.cat([*parts, w[q + k:]])


def _rope_and_mask(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's (cos, sin) (1, T, head_dim), additive mask (B, 1, T, T) and position_ids (1, T)
    -> the port's freqs_cis (T, head_dim/2, 2), boolean mask and input_pos (T,)."""
    cos, sin = kwargs["position_embeddings"]
    half = cos.shape[-1] // 2
    freqs_cis = torch.stack([cos[0, :, :half], sin[0, :, :half]], dim=-1)
    mask = kwargs["attention_mask"] == 0
    if bool((mask == mask[:1]).all()):
        mask = mask[:1]  # the port builds one mask for the whole batch
    return freqs_cis, mask, kwargs["position_ids"][0]


def block_call(*args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """MixtralDecoderLayer(hidden_states, attention_mask=, position_ids=,
    position_embeddings=, ...) -> TransformerBlock(x, input_pos, freqs_cis, mask)."""
    x = args[0] if args else kwargs["hidden_states"]
    freqs_cis, mask, input_pos = _rope_and_mask(kwargs)
    return (x, input_pos, freqs_cis, mask), {}


def attention_call(*args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """MixtralAttention(hidden_states=, position_embeddings=, attention_mask=, ...) ->
    Attention(x, freqs_cis, mask, input_pos)."""
    x = args[0] if args else kwargs["hidden_states"]
    freqs_cis, mask, input_pos = _rope_and_mask(kwargs)
    return (x, freqs_cis, mask, input_pos), {}


def root_call(*args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """MixtralForCausalLM(input_ids=, labels=, use_cache=) -> Transformer(idx, input_pos)."""
    ids = args[0] if args else kwargs["input_ids"]
    return (ids, torch.arange(ids.shape[1])), {}


def weighted_sum(expert_outs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The port's experts' unweighted outputs (tokens, k, dim) and HF's routing weights
    (tokens, k), HF's experts' input 'top_k_weights' -> HF's experts' output (tokens, dim)."""
    return torch.einsum("tai,ta -> ti", expert_outs, weights.to(expert_outs.dtype))


# ---------------------------------------------------------------- planted bugs

def port_bug_expert() -> Case:
    model = _port_model()
    ffn = model.layers[0].block_sparse_moe.cond_ffn

    def forward(self, x, expert_indices):
        w1, w3, w2 = self.w1[expert_indices], self.w3[expert_indices], self.w2[expert_indices]
        x1 = F.silu(torch.einsum("ti,taoi -> tao", x, w1))
        x3 = torch.einsum("ti, taoi -> tao", x, w3)
        x3 = torch.where((expert_indices == 2)[..., None], F.silu(x3), x3)  # BUG: expert 2
        return torch.einsum("tao, taio -> tai", (x1 * x3), w2)

    ffn.forward = types.MethodType(forward, ffn)
    return _case(model, "port_bug_expert")


def _layer1_block_combining(combine: Any, name: str) -> Case:
    """The port with its layer-1 MoE block's last line replaced: ``combine(expert_outs,
    weights)`` from the chosen experts' unweighted outputs (T, k, D) and their top-k softmax
    probabilities (T, k), as the block computes them."""
    model = _port_model()
    moe = model.layers[1].block_sparse_moe

    def forward(self, x):
        shape = x.shape
        x = x.view(-1, self.dim)
        weights = F.softmax(self.gate(x), dim=-1)
        weights, indices = torch.topk(weights, self.num_activated_experts, dim=-1)
        return combine(self.cond_ffn(x, indices), weights).view(shape)

    moe.forward = types.MethodType(forward, moe)
    return _case(model, name)


def port_bug_renorm() -> Case:  # BUG: the top-k weights are not renormalised
    return _layer1_block_combining(weighted_sum, "port_bug_renorm")


def port_bug_unweighted() -> Case:  # BUG: the chosen experts' outputs summed without weights
    return _layer1_block_combining(lambda outs, weights: outs.sum(dim=1), "port_bug_unweighted")


def port_bug_detached() -> Case:  # BUG: the weights detached, so the router never learns
    return _layer1_block_combining(
        lambda outs, weights: weighted_sum(outs, (weights / weights.sum(-1, keepdim=True))
                                           .detach()), "port_bug_detached")


def reference_experts_unweighted() -> Case:
    """The reference whose layer-1 experts ignore the routing weights HF passes them (a port
    that weights inside its experts, as HF does, and forgot to)."""
    case = reference()
    experts = case.model.model.layers[1].mlp.experts
    unweighted = experts.forward

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return unweighted(hidden_states, top_k_index, torch.ones_like(top_k_weights))  # BUG

    experts.forward = types.MethodType(forward, experts)
    return dataclasses.replace(case, name="tests.validation.moe_cases:reference_experts_unweighted")


def port_bug_rope() -> Case:
    model = _port_model()
    attention = model.layers[0].attention

    def forward(self, x, freqs_cis, mask, input_pos=None):
        flipped = torch.stack([freqs_cis[..., 0], -freqs_cis[..., 1]], -1)  # BUG: wrong way
        return G.Attention.forward(self, x, flipped, mask, input_pos)

    attention.forward = types.MethodType(forward, attention)
    return _case(model, "port_bug_rope")


def port_bug_eps() -> Case:
    model = _port_model()
    model.layers[1].attention_norm.eps = 1e-3  # BUG: 1e-5 wanted
    return _case(model, "port_bug_eps")


class _RMSNormBadBackward(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps): right forward; the backward treats the normaliser as a
    constant (drops d rsqrt / dx)."""

    @staticmethod
    def forward(ctx, x, eps):
        scale = torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale, None  # BUG: the normaliser's own derivative is missing


def port_bug_backward() -> Case:
    model = _port_model()
    norm = model.layers[0].ffn_norm
    norm._norm = types.MethodType(lambda self, x: _RMSNormBadBackward.apply(x, self.eps), norm)
    return _case(model, "port_bug_backward")


# ---------------------------------------------------------------- a planted routing near-tie

TIE_TOKEN = (1, 6)   # (batch, position) whose router scores are made to nearly tie in layer 0
TIE_GAP = 2e-4       # its k-th and (k+1)-th logits apart by this (bfloat16 rounds both alike)


def _near_tie_model():
    """The reference with layer 0's router rows of two experts moved so that, for TIE_TOKEN,
    the k-th and (k+1)-th logits differ by TIE_GAP, both on one bfloat16 value: a port that
    rounds them ties, and torch.topk then takes one of the two; the reference is made to take
    the other (which one torch.topk takes on a tie is its kernel's business, so it is tried)."""
    model = H.mixtral()
    ids, _ = _batch()
    gate = model.model.layers[0].mlp.gate
    seen = {}
    handle = gate.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    x = seen["x"].reshape(-1, H.DIM)[TIE_TOKEN[0] * SEQ + TIE_TOKEN[1]].double()
    with torch.no_grad():
        weight = gate.weight.double()
        logits = weight @ x
        ranked = torch.argsort(logits, descending=True).tolist()
        pair = ranked[H.TOP_K - 1], ranked[H.TOP_K]
        top = float(logits[pair[0]].to(torch.bfloat16))  # exactly a bfloat16 value
        for above, below in (pair, pair[::-1]):
            moved = logits.clone()
            moved[above], moved[below] = top, top - TIE_GAP
            chosen = set(torch.topk(moved.float(), H.TOP_K).indices.tolist())
            tied = torch.topk(F.softmax(moved.float().to(torch.bfloat16), dim=-1), H.TOP_K)
            if set(tied.indices.tolist()) != chosen:
                break
        else:
            raise AssertionError("torch.topk takes the reference's expert either way")
        weight += torch.outer(moved - logits, x) / (x @ x)
        gate.weight.copy_(weight.float())
    return model


def reference_near_tie() -> Case:
    ids, labels = _batch()
    return Case(model=_near_tie_model().train(),
                inputs={"input_ids": ids, "labels": labels, "use_cache": False},
                loss_fn=lambda out: out.loss, seed=H.SEED, steps=1, optimizer=_sgd,
                name="tests.validation.moe_cases:reference_near_tie")


def _bf16_router_block(self, x):
    """The MoE block with its router softmax and top-k in bfloat16 (as many inference ports
    run it); the rest as the port's own."""
    shape = x.shape
    x = x.view(-1, self.dim)
    weights = F.softmax(self.gate(x).to(torch.bfloat16), dim=-1)
    weights, indices = torch.topk(weights, self.num_activated_experts, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
    return torch.einsum("tai,ta -> ti", self.cond_ffn(x, indices), weights).view(shape)


def port_router_bf16() -> Case:
    """The port with every MoE block's router in bfloat16: not a bug in float32's terms, but
    the planted near-tie flips."""
    model = _port_model()
    for layer in model.layers:
        moe = layer.block_sparse_moe
        moe.forward = types.MethodType(_bf16_router_block, moe)
    return _case(model, "port_router_bf16")


def _bf16_choice_block(self, x):
    """The MoE block choosing its experts from a bfloat16 copy of the router probabilities but
    weighting them with the float32 ones: its routing is the only thing that differs."""
    shape = x.shape
    x = x.view(-1, self.dim)
    probs = F.softmax(self.gate(x), dim=-1)
    _, indices = torch.topk(probs.to(torch.bfloat16), self.num_activated_experts, dim=-1)
    weights = probs.gather(-1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("tai,ta -> ti", self.cond_ffn(x, indices), weights).view(shape)


def port_chooses_in_bf16() -> Case:
    """The port whose MoE blocks choose experts in bfloat16 and weight them in float32: on the
    near-tie it routes one token elsewhere, and nothing else differs."""
    model = _port_model()
    for layer in model.layers:
        moe = layer.block_sparse_moe
        moe.forward = types.MethodType(_bf16_choice_block, moe)
    return _case(model, "port_chooses_in_bf16")


def reference_router_bf16() -> Case:
    """The near-tie reference run the way port_router_bf16 runs its router (softmax and top-k
    in bfloat16): the baseline that makes the same flip."""
    case = reference_near_tie()
    for layer in case.model.model.layers:
        router = layer.mlp.gate

        def forward(self, hidden_states):
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = F.linear(hidden_states, self.weight)
            probs = F.softmax(logits.to(torch.bfloat16), dim=-1)
            top, index = torch.topk(probs, self.top_k, dim=-1)
            return logits, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), index

        router.forward = types.MethodType(forward, router)
    case.name = "tests.validation.moe_cases:reference_router_bf16"
    return case
