"""Small models with one planted bug each, for the likely-cause hints whose evidence issue 39
(item 8) asked for (tests/test_hints_evidence.py): a recurrence from a zero state (a
selective-scan-like layer) with another decay, which must not read as a rotary embedding; a
rotary module taking position ids with the sine negated, which must not read as a mask; a
rotary table rounded to bfloat16 inside a float32 port; an RMS norm's epsilon; a Gemma-style
norm weight offset (1 + w). Each function returns (reference, port) cases, the port holding the
reference's weights."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

BATCH, LENGTH, WIDTH = 3, 12, 16
HEADS, HEAD_DIM = 2, 8


def _case(model: nn.Module, inputs: tuple, name: str) -> Case:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out.float() ** 2).mean()

    return Case(model=model, inputs=inputs, loss_fn=loss_fn, seed=0, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name=name)


def _pair(build, inputs: tuple, name: str, **bug) -> tuple[Case, Case]:
    seed_everything(0)
    reference = build()
    port = build(**bug)
    port.load_state_dict(reference.state_dict(), strict=True)
    return (_case(reference, inputs, f"tests.hint_evidence_cases:{name}_reference"),
            _case(port, inputs, f"tests.hint_evidence_cases:{name}"))


# ---- a recurrence from a zero state: h_t = a h_{t-1} + b x_t


class Scan(nn.Module):
    """A diagonal linear recurrence over the positions, as a selective scan's core: the state
    starts at zero, so position 0 is b x_0 whatever the decay."""

    def __init__(self, width: int, decay_squared: bool = False) -> None:
        super().__init__()
        self.log_rate = nn.Parameter(torch.linspace(-2.5, 0.0, width))
        self.gain = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))
        self.decay_squared = decay_squared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.exp(-torch.exp(self.log_rate))        # decay in (0, 1), one per feature
        if self.decay_squared:
            a = a * a                                   # BUG: the decay applied twice
        h = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            h = a * h + self.gain * x[:, t]
            out.append(h)
        return torch.stack(out, 1)


class ScanModel(nn.Module):
    def __init__(self, decay_squared: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.scan = Scan(WIDTH, decay_squared)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scan(self.inp(x)))


def scan_decay() -> tuple[Case, Case]:
    seed_everything(1)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    return _pair(ScanModel, (x,), "scan_decay", decay_squared=True)


# ---- rotary embeddings


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


class Rotary(nn.Module):
    """Rotates x (batch, length, heads, d) by the positions it is given, as position ids
    (batch, length), half-split pairs (x[i], x[i + d/2])."""

    def __init__(self, head_dim: int, base: float = 10000.0, sign: float = 1.0) -> None:
        super().__init__()
        self.head_dim, self.base, self.sign = head_dim, base, sign

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        inv = self.base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = position_ids[..., None].float() * inv                 # (batch, length, d/2)
        angles = torch.cat([angles, angles], -1)[:, :, None, :]        # (batch, length, 1, d)
        return x * angles.cos() + self.sign * rotate_half(x) * angles.sin()


class RotaryAttention(nn.Module):
    """Causal attention whose q and k go through a rotary module with the position ids."""

    def __init__(self, sign: float = 1.0) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.q_proj, self.k_proj = nn.Linear(WIDTH, width), nn.Linear(WIDTH, width)
        self.v_proj, self.o_proj = nn.Linear(WIDTH, width), nn.Linear(width, WIDTH)
        self.rotary = Rotary(HEAD_DIM, sign=sign)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.rotary(self.q_proj(x).view(b, n, HEADS, HEAD_DIM), position_ids)
        k = self.rotary(self.k_proj(x).view(b, n, HEADS, HEAD_DIM), position_ids)
        v = self.v_proj(x).view(b, n, HEADS, HEAD_DIM)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM))


class RotaryModel(nn.Module):
    def __init__(self, sign: float = 1.0) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.attn = RotaryAttention(sign)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.inp(x), position_ids))


def _positions() -> torch.Tensor:
    return torch.arange(LENGTH).expand(BATCH, LENGTH).contiguous()


def rotary_sign_position_ids() -> tuple[Case, Case]:
    seed_everything(1)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    return _pair(RotaryModel, (x, _positions()), "rotary_sign_position_ids", sign=-1.0)


class TableAttention(nn.Module):
    """Llama-style attention (q, k, v, o projections as sub-modules) whose own code makes the
    rotary tables and rotates q and k; the port may keep the table in bfloat16 (a cache cast
    for speed) and multiply its float32 q and k by it."""

    def __init__(self, table_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        width = HEADS * HEAD_DIM
        self.q_proj, self.k_proj = nn.Linear(WIDTH, width), nn.Linear(WIDTH, width)
        self.v_proj, self.o_proj = nn.Linear(WIDTH, width), nn.Linear(width, WIDTH)
        self.table_dtype = table_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        inv = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        angles = torch.outer(torch.arange(n, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos().to(self.table_dtype), angles.sin().to(self.table_dtype)
        split = lambda t: t.view(b, n, HEADS, HEAD_DIM).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        q = q * cos + rotate_half(q) * sin       # float32 x bfloat16 -> float32
        k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM))


class TableModel(nn.Module):
    def __init__(self, table_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.attn = TableAttention(table_dtype)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.inp(x)))


def rotary_table_bf16() -> tuple[Case, Case]:
    seed_everything(1)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    return _pair(TableModel, (x,), "rotary_table_bf16", table_dtype=torch.bfloat16)


class PassedTable(nn.Module):
    """Attention that takes its rotary tables as inputs, as Meta's Llama passes freqs_cos and
    freqs_sin to every layer; the model's own code makes them (the port keeps them in
    bfloat16)."""

    def __init__(self, table_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.attn = PassedTableAttention()
        self.head = nn.Linear(WIDTH, 4)
        self.table_dtype = table_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        inv = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
        angles = torch.outer(torch.arange(n, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos().to(self.table_dtype), angles.sin().to(self.table_dtype)
        return self.head(self.attn(self.inp(x), cos, sin))


class PassedTableAttention(TableAttention):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, HEADS, HEAD_DIM).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, n, HEADS * HEAD_DIM))


def passed_table_bf16() -> tuple[Case, Case]:
    seed_everything(1)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    return _pair(PassedTable, (x,), "passed_table_bf16", table_dtype=torch.bfloat16)


# ---- normalization


class RMSNorm(nn.Module):
    """RMS norm; ``offset``: Gemma's, x_hat (1 + w) with w stored as an offset from 1."""

    def __init__(self, width: int, eps: float = 1e-6, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(width))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xhat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return xhat * ((1.0 + self.weight) if self.offset else self.weight)


class NormModel(nn.Module):
    def __init__(self, eps: float = 1e-6, offset: bool = False,
                 scales: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.norm = RMSNorm(WIDTH, eps, offset)
        self.head = nn.Linear(WIDTH, 4)
        # scales: the rows' sizes spread from 10^lo to 10^hi over the positions (activations
        # of a layer that starts near zero), where an epsilon of 1e-6 or 1e-5 shows
        rows = (torch.logspace(*scales, LENGTH)[None, :, None] if scales
                else torch.ones(1, LENGTH, 1))
        self.register_buffer("row_scale", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.inp(x) * self.row_scale))


def rms_norm_eps(reference_eps: float, port_eps: float,
                 scales: tuple[float, float] = (-4.0, -1.0)) -> tuple[Case, Case]:
    seed_everything(1)
    x = torch.randn(BATCH, LENGTH, WIDTH)

    def build(eps: float = reference_eps) -> NormModel:
        return NormModel(eps=eps, scales=scales)

    return _pair(build, (x,), "rms_norm_eps", eps=port_eps)


def norm_offset(reference_offset: bool) -> tuple[Case, Case]:
    seed_everything(1)
    x = torch.randn(BATCH, LENGTH, WIDTH)

    def build(offset: bool = reference_offset) -> NormModel:
        return NormModel(offset=offset)

    return _pair(build, (x,), "norm_offset", offset=not reference_offset)
