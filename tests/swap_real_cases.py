"""Reference code that reads attributes of its own layers, and ports that compute the same
numbers their own way, for tests/test_swap_real.py.

Real model code does not only call its children: Whisper's encoder reads
``self.conv1.stride[0]`` and ``self.embed_positions.num_embeddings``, Llama-style code
``self.norm.weight.dtype``, a block ``self.self_attn.num_heads``; a Mixtral-style MoE block
takes ``(logits, weights, selected experts)`` from its router and calls
``F.one_hot(selected, num_classes=self.router.num_experts)``. A port layer swapped in where such
code runs must answer those reads; a port router that returns its logits alone (its MoE block
does the top-k) cannot stand in for that router at all, and the swap cannot judge it.

``reference`` (written as Hugging Face writes its models, unedited by the tests) is a
Whisper-like audio classifier: two strided convolutions, learned positions, encoder layers of
attention and a mixture of experts. ``port`` computes the same numbers with its own code, its
own attribute names (``n_head``, its own config class) and its own router; the bugs are planted
in one place each: ``port_bug_moe`` in block 1's MoE block's own code (the top-k weights not
renormalised: a container bug), ``port_bug_norm`` in a leaf (block 0's final norm with epsilon
1). ``whisper_reference`` is transformers' own ``WhisperForAudioClassification`` (a tiny random
config), against ``whisper_port``, an independent port written here, and ``whisper_port_bug``
(block 1's own code: the tanh GELU).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
MEL, DIM, HEADS, EXPERTS, TOP_K, LAYERS, POSITIONS, CLASSES, BATCH = 4, 16, 2, 4, 2, 2, 6, 3, 4


@dataclasses.dataclass
class RefConfig:
    max_source_positions: int = POSITIONS
    num_heads: int = HEADS


# ---- the reference: the way Hugging Face model code reads its layers
class RefAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.head_dim = DIM // HEADS
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM)
        self.out_proj = nn.Linear(DIM, DIM)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        weights = torch.softmax(q @ k.transpose(-1, -2) * self.scaling, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, t, DIM)
        return self.out_proj(out), (weights if output_attentions else None)


class RefRouter(nn.Module):
    """A leaf: its weight is its own; it returns (logits, top-k weights, top-k experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.top_k = TOP_K
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM) / math.sqrt(DIM))

    def forward(self, hidden_states: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states, self.weight)
        weights, selected = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), selected


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class RefMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = RefRouter()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        _, weights, selected = self.router(hidden_states)
        mask = F.one_hot(selected, num_classes=self.router.num_experts)  # (B, T, k, E)
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts):
            out = out + (weights * mask[..., e]).sum(-1, keepdim=True) * expert(hidden_states)
        return out


class RefLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = RefAttention()
        self.self_attn_layer_norm = nn.LayerNorm(DIM)
        self.moe = RefMoE()
        self.final_layer_norm = nn.LayerNorm(DIM)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        if hidden_states.shape[-1] % self.self_attn.num_heads:
            raise ValueError("hidden size is not a multiple of the number of heads")
        residual = hidden_states
        hidden_states, _ = self.self_attn(hidden_states=self.self_attn_layer_norm(hidden_states),
                                          attention_mask=attention_mask)
        hidden_states = residual + hidden_states
        # as Llama-style code casts before its norm: the norm's weight decides the dtype
        normed = self.final_layer_norm(hidden_states.to(self.final_layer_norm.weight.dtype))
        return hidden_states + self.moe(normed)


class RefEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = RefConfig()
        self.conv1 = nn.Conv1d(MEL, DIM, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(DIM, DIM, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(POSITIONS, DIM)
        self.layers = nn.ModuleList(RefLayer() for _ in range(LAYERS))
        self.layer_norm = nn.LayerNorm(DIM)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        expected = self.config.max_source_positions * self.conv1.stride[0] * self.conv2.stride[0]
        if input_features.shape[-1] != expected:
            raise ValueError(f"expects features of length {expected}, "
                             f"got {input_features.shape[-1]}")
        h = F.gelu(self.conv2(F.gelu(self.conv1(input_features)))).permute(0, 2, 1)
        positions = torch.arange(self.embed_positions.num_embeddings, device=h.device)
        h = h + self.embed_positions(positions)
        for layer in self.layers:
            h = layer(h, None)
        return self.layer_norm(h)


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = RefEncoder()
        self.classifier = nn.Linear(DIM, CLASSES)

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        positions = self.encoder.config.max_source_positions
        pooled = self.encoder(input_features)[:, :positions].mean(dim=1)
        return self.classifier(pooled.to(self.classifier.weight.dtype))


# ---- the port: the same numbers, its own code, names and config
@dataclasses.dataclass
class PortConfig:
    n_ctx: int = POSITIONS


class PortAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = HEADS
        self.q_proj = nn.Linear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM)
        self.out_proj = nn.Linear(DIM, DIM)
        self.scaled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scale = None if self.scaled else 1.0
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, DIM))


class PortRouter(nn.Module):
    """Returns the logits alone: the port's MoE block chooses the experts."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(EXPERTS, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class PortMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = PortRouter()
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.renormalise = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = self.router(x).softmax(-1)
        top, chosen = probabilities.topk(TOP_K, dim=-1)
        if self.renormalise:
            top = top / top.sum(-1, keepdim=True)
        gates = torch.zeros_like(probabilities).scatter(-1, chosen, top)  # (B, T, E)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=-1)  # (B, T, D, E)
        return (outputs * gates.unsqueeze(-2)).sum(-1)


class PortLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = PortAttention()
        self.self_attn_layer_norm = nn.LayerNorm(DIM)
        self.moe = PortMoE()
        self.final_layer_norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.moe(self.final_layer_norm(x))


class PortEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = PortConfig()
        self.conv1 = nn.Conv1d(MEL, DIM, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(DIM, DIM, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(POSITIONS, DIM)
        self.layers = nn.ModuleList(PortLayer() for _ in range(LAYERS))
        self.layer_norm = nn.LayerNorm(DIM)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(features))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        x = x + self.embed_positions(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class Port(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = PortEncoder()
        self.classifier = nn.Linear(DIM, CLASSES)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(features).mean(dim=1))


# ---- cases
def _case(model: nn.Module, name: str, length: int, mel: int, classes: int,
          inputs: torch.Tensor | None = None) -> Case:
    seed_everything(SEED + 1)  # the data: the same for every model
    features = torch.randn(BATCH, mel, length) if inputs is None else inputs
    labels = torch.randint(classes, (BATCH,))

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output if torch.is_tensor(output) else output.logits
        return F.cross_entropy(logits, labels)

    return Case(model=model, inputs=(features,), loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"tests.swap_real_cases:{name}")


def _model(cls: type[nn.Module]) -> nn.Module:
    seed_everything(SEED)
    return cls()


def reference() -> Case:
    return _case(_model(Reference), "reference", 2 * POSITIONS, MEL, CLASSES)


def port() -> Case:
    return _case(_model(Port), "port", 2 * POSITIONS, MEL, CLASSES)


def port_bug_moe() -> Case:
    case = port()
    case.model.encoder.layers[1].moe.renormalise = False  # BUG: top-k weights not renormalised
    return dataclasses.replace(case, name="tests.swap_real_cases:port_bug_moe")


def port_bug_norm() -> Case:
    case = port()
    case.model.encoder.layers[0].final_layer_norm.eps = 1.0  # BUG: epsilon 1, not 1e-5
    return dataclasses.replace(case, name="tests.swap_real_cases:port_bug_norm")


# ---- transformers' own Whisper audio classifier, and a port of it written here
W_DIM, W_HEADS, W_LAYERS, W_FFN, W_MEL, W_POSITIONS, W_PROJ, W_CLASSES = 16, 2, 2, 32, 4, 6, 8, 3


def whisper_reference() -> Case:
    """``WhisperForAudioClassification`` (transformers 5.x, eager attention, random weights):
    its encoder reads ``self.conv1.stride[0]``, ``self.conv2.stride[0]`` and
    ``self.embed_positions.num_embeddings``, and its classifier head ``encoder_outputs[0]``
    of the encoder's ``BaseModelOutput``."""
    from transformers import WhisperConfig, WhisperForAudioClassification

    config = WhisperConfig(d_model=W_DIM, encoder_layers=W_LAYERS, decoder_layers=1,
                           encoder_attention_heads=W_HEADS, decoder_attention_heads=W_HEADS,
                           encoder_ffn_dim=W_FFN, decoder_ffn_dim=W_FFN, num_mel_bins=W_MEL,
                           max_source_positions=W_POSITIONS, max_target_positions=8,
                           classifier_proj_size=W_PROJ, num_labels=W_CLASSES, vocab_size=32,
                           dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0,
                           decoder_start_token_id=0)
    config._attn_implementation = "eager"
    seed_everything(SEED)
    model = WhisperForAudioClassification(config)
    with torch.no_grad():  # weights of a trained model's scale: HF's std 0.02 hides bugs in atol
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5)
            elif "layer_norm" not in name:
                param.normal_(0.0, 0.1)
    return _case(model, "whisper_reference", 2 * W_POSITIONS, W_MEL, W_CLASSES)


class WhisperPortAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = W_HEADS
        self.q_proj = nn.Linear(W_DIM, W_DIM)
        self.k_proj = nn.Linear(W_DIM, W_DIM, bias=False)
        self.v_proj = nn.Linear(W_DIM, W_DIM)
        self.out_proj = nn.Linear(W_DIM, W_DIM)
        self.scale = (W_DIM // W_HEADS) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).reshape(b, t, self.heads, -1).permute(0, 2, 1, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        attention = torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale, -1)
        out = torch.einsum("bhqk,bhkd->bqhd", attention, v).reshape(b, t, W_DIM)
        return self.out_proj(out)


class WhisperPortLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = WhisperPortAttention()
        self.self_attn_layer_norm = nn.LayerNorm(W_DIM)
        self.fc1 = nn.Linear(W_DIM, W_FFN)
        self.fc2 = nn.Linear(W_FFN, W_DIM)
        self.final_layer_norm = nn.LayerNorm(W_DIM)
        self.approximate = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        hidden = F.gelu(self.fc1(self.final_layer_norm(x)), approximate=self.approximate)
        return x + self.fc2(hidden)


class WhisperPortEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(W_MEL, W_DIM, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(W_DIM, W_DIM, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(W_POSITIONS, W_DIM)
        self.embed_positions.requires_grad_(False)
        self.layers = nn.ModuleList(WhisperPortLayer() for _ in range(W_LAYERS))
        self.layer_norm = nn.LayerNorm(W_DIM)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = x + self.embed_positions(torch.arange(W_POSITIONS, device=x.device))
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperPort(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = WhisperPortEncoder()
        self.projector = nn.Linear(W_DIM, W_PROJ)
        self.classifier = nn.Linear(W_PROJ, W_CLASSES)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.projector(self.encoder(mel)).mean(dim=1))


def whisper_port() -> Case:
    return _case(_model(WhisperPort), "whisper_port", 2 * W_POSITIONS, W_MEL, W_CLASSES)


def whisper_port_bug() -> Case:
    case = whisper_port()
    # BUG: the feed-forward's GELU in the layer's own code is the tanh approximation (HF's
    # tiny random init, std 0.02, leaves attention scores near 0: an unscaled score hides)
    case.model.encoder.layers[1].approximate = "tanh"
    return dataclasses.replace(case, name="tests.swap_real_cases:whisper_port_bug")


# ---- transformers' own Mixtral (a sparse MoE causal LM), and a port of it written here
M_VOCAB, M_DIM, M_HEADS, M_KV, M_LAYERS, M_FFN, M_EXPERTS, M_TOP_K, M_LENGTH = (
    32, 16, 4, 2, 2, 24, 4, 2, 8)
M_HEAD_DIM, M_THETA, M_EPS = M_DIM // M_HEADS, 10000.0, 1e-6


def _scaled_init(model: nn.Module) -> None:
    """Weights of a trained model's scale (HF's std 0.02 leaves every value below float32's
    absolute tolerance, where no bug shows)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            elif "norm" not in name:
                param.normal_(0.0, 0.1)


def _lm_case(model: nn.Module, name: str) -> Case:
    seed_everything(SEED + 1)
    tokens = torch.randint(M_VOCAB, (BATCH, M_LENGTH + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output if torch.is_tensor(output) else output.logits
        return F.cross_entropy(logits.reshape(-1, M_VOCAB), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"tests.swap_real_cases:{name}")


def mixtral_reference() -> Case:
    """``MixtralForCausalLM`` (transformers 5.x, eager attention, grouped-query, random
    weights): its sparse MoE block takes ``_, top_k_weights, top_k_index = self.gate(h)`` and
    hands them to its experts, which one-hot the index."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=M_VOCAB, hidden_size=M_DIM, intermediate_size=M_FFN,
                           num_hidden_layers=M_LAYERS, num_attention_heads=M_HEADS,
                           num_key_value_heads=M_KV, num_local_experts=M_EXPERTS,
                           num_experts_per_tok=M_TOP_K, max_position_embeddings=64,
                           rms_norm_eps=M_EPS, rope_theta=M_THETA, tie_word_embeddings=False,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    seed_everything(SEED)
    model = MixtralForCausalLM(config)
    _scaled_init(model)
    return _lm_case(model, "mixtral_reference")


class MixNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(M_DIM))
        self.eps = M_EPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class MixAttention(nn.Module):
    """Its own rotary tables and causal mask: it takes the hidden states alone."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(M_DIM, M_HEADS * M_HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(M_DIM, M_KV * M_HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(M_DIM, M_KV * M_HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(M_HEADS * M_HEAD_DIM, M_DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, M_HEADS, M_HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, t, M_KV, M_HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, t, M_KV, M_HEAD_DIM).transpose(1, 2)
        inverse = M_THETA ** -(torch.arange(0, M_HEAD_DIM, 2, device=x.device).float()
                               / M_HEAD_DIM)
        angles = torch.outer(torch.arange(t, device=x.device).float(), inverse).repeat(1, 2)
        cos, sin = angles.cos(), angles.sin()

        def rotate(u: torch.Tensor) -> torch.Tensor:
            first, second = u.chunk(2, dim=-1)
            return u * cos + torch.cat([-second, first], dim=-1) * sin

        q, k = rotate(q), rotate(k)
        k, v = (u.repeat_interleave(M_HEADS // M_KV, dim=1) for u in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, M_DIM))


class MixRouter(nn.Module):
    """The router's logits alone: the port's MoE block chooses the experts."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(M_EXPERTS, M_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class MixExperts(nn.Module):
    """Every expert on every token, weighted by a dense gate (0 for the experts not chosen)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(M_EXPERTS, 2 * M_FFN, M_DIM))
        self.down_proj = nn.Parameter(torch.zeros(M_EXPERTS, M_DIM, M_FFN))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        gates = torch.zeros(x.shape[0], M_EXPERTS, dtype=x.dtype, device=x.device).scatter(
            -1, top_k_index, top_k_weights.to(x.dtype))
        gate, up = torch.einsum("nd,efd->nef", x, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("nef,edf->ned", F.silu(gate) * up, self.down_proj)
        return (out * gates.unsqueeze(-1)).sum(dim=1)


class MixMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = MixRouter()
        self.experts = MixExperts()
        self.renormalise = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, M_DIM)
        weights, chosen = self.gate(flat).float().softmax(-1).topk(M_TOP_K, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(flat, chosen, weights).view_as(x)


class MixLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = MixAttention()
        self.mlp = MixMoE()
        self.input_layernorm = MixNorm()
        self.post_attention_layernorm = MixNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MixModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(M_VOCAB, M_DIM, padding_idx=0)  # as Mixtral: no gradient
        self.layers = nn.ModuleList(MixLayer() for _ in range(M_LAYERS))
        self.norm = MixNorm()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class MixPort(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = MixModel()
        self.lm_head = nn.Linear(M_DIM, M_VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def mixtral_port() -> Case:
    return _lm_case(_model(MixPort), "mixtral_port")


def mixtral_port_bug() -> Case:
    case = mixtral_port()
    case.model.model.layers[1].mlp.renormalise = False  # BUG: top-k weights not renormalised
    return dataclasses.replace(case, name="tests.swap_real_cases:mixtral_port_bug")
