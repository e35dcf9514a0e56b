"""Optimizer differences for ``diverge``: a small pre-norm transformer classifier trained with
AdamW, and a port of it written independently (fused q/k/v, its own names, see
optimizer_cases.map.toml), each port trained with one optimizer detail changed the way ports
really get them wrong:

- ``port_norm_exempt``: the port keeps the norm weights out of weight decay (as GPT-style
  training code does), the reference decays them;
- ``port_warmup_ahead``: the port's linear warm-up reads its schedule one update ahead;
- ``port_betas``: the port uses betas (0.9, 0.95), the reference PyTorch's (0.9, 0.999);
- ``port_eps``: the port uses Keras's epsilon 1e-7, the reference PyTorch's 1e-8;
- ``port_lr_norm_exempt``: twice the learning rate, and the norm weights exempt from decay;
- ``port_own_adamw_betas``: the port's own AdamW (its state named m, v, t) with betas
  (0.9, 0.95);
- ``port_stale_scale``: not an optimizer bug: the port's attention caches its scale on the
  first call, rounded to bfloat16, so its forward differs from step 1 on.

Param groups are split by parameter name, as training code does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 3
BATCH, TOKENS, WIDTH, CLASSES, BLOCKS = 8, 6, 24, 5, 2
LR, WEIGHT_DECAY, WARMUP = 1e-3, 0.01, 4
STEPS = 4
MAPPING = str(Path(__file__).with_suffix(".map.toml"))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(WIDTH)
        return self.o(torch.softmax(scores, dim=-1) @ self.v(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))


class FusedAttention(nn.Module):
    """q, k and v from one matrix, as most ports write it."""

    def __init__(self, stale_scale: bool = False) -> None:
        super().__init__()
        self.in_proj_weight = nn.Parameter(torch.empty(3 * WIDTH, WIDTH))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * WIDTH))
        self.proj = nn.Linear(WIDTH, WIDTH)
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.stale_scale = stale_scale
        self.scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        scale = torch.tensor(1 / math.sqrt(WIDTH))
        if self.stale_scale:  # the bug: a cache filled on the first call, in bfloat16
            if self.scale is not None:
                scale = self.scale
            self.scale = scale.to(torch.bfloat16).float()
        return self.proj(torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v)


class FusedBlock(nn.Module):
    def __init__(self, stale_scale: bool = False) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(WIDTH), FusedAttention(stale_scale)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.fc, self.proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class PortClassifier(nn.Module):
    def __init__(self, stale_scale: bool = False) -> None:
        super().__init__()
        self.wte = nn.Linear(WIDTH, WIDTH)
        self.h = nn.ModuleList(FusedBlock(stale_scale) for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.wte(x)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x).mean(dim=1))


class WarmupAdamW(torch.optim.AdamW):
    """AdamW with a linear warm-up to ``lr`` over ``WARMUP`` updates, set inside ``step()`` (a
    Case has one optimizer factory). ``ahead`` 1 reads the schedule one update ahead."""

    def __init__(self, params: Iterable, *, lr: float, ahead: int = 0, **options) -> None:
        super().__init__(params, lr=lr, **options)
        self.peak, self.ahead, self.updates = lr, ahead, 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for group in self.param_groups:
            group["lr"] = self.peak * min(1.0, (self.updates + 1 + self.ahead) / WARMUP)
        self.updates += 1
        return super().step(closure)


class OwnAdamW(torch.optim.Optimizer):
    """AdamW as a port writes it from the paper: its own state names, the bias corrections
    folded into the step size."""

    def __init__(self, params: Iterable, *, lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": betas,
                                  "eps": eps})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(m=torch.zeros_like(p), v=torch.zeros_like(p), t=0)
                state["t"] += 1
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                size = group["lr"] / (1 - beta1 ** state["t"])
                root = (state["v"] / (1 - beta2 ** state["t"])).sqrt_().add_(group["eps"])
                p.addcdiv_(state["m"], root, value=-size)


def _groups(model: nn.Module, exempt: Callable[[str], bool]) -> list[dict]:
    """Decayed and exempt parameters, split by name."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not exempt(n)]},
            {"params": [p for n, p in named if exempt(n)], "weight_decay": 0.0}]


def _is_bias(name: str) -> bool:
    return name.endswith("bias")


def _is_bias_or_norm(name: str) -> bool:
    return _is_bias(name) or ".ln_" in name or name.startswith("ln_")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    draw = torch.Generator().manual_seed(SEED)
    return (torch.randn(BATCH, TOKENS, WIDTH, generator=draw),
            torch.randint(0, CLASSES, (BATCH,), generator=draw))


def _case(model: nn.Module, exempt: Callable[[str], bool], name: str, *,
          optimizer: type[torch.optim.Optimizer] = torch.optim.AdamW, **options) -> Case:
    x, y = _data()
    settings = {"lr": LR, "weight_decay": WEIGHT_DECAY, **options}
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, y),
                seed=SEED, steps=STEPS,
                optimizer=lambda params: optimizer(_groups(model, exempt), **settings),
                name=f"tests.optimizer_cases:{name}")


def reference(**options) -> Case:
    """The classifier, AdamW with decay on every weight but the biases."""
    seed_everything(SEED)
    return _case(Classifier(), _is_bias, "reference", **options)


def _port(name: str, exempt: Callable[[str], bool] = _is_bias, stale_scale: bool = False,
          **options) -> Case:
    seed_everything(SEED + 1)  # weights of its own until diverge loads the reference's
    model = PortClassifier(stale_scale)
    return _case(model, exempt, name, **options)


def port() -> Case:
    """The port, trained as the reference is."""
    return _port("port")


def port_norm_exempt() -> Case:
    return _port("port_norm_exempt", _is_bias_or_norm)


def reference_warmup() -> Case:
    seed_everything(SEED)
    return _case(Classifier(), _is_bias, "reference_warmup", optimizer=WarmupAdamW)


def port_warmup_ahead() -> Case:
    return _port("port_warmup_ahead", optimizer=WarmupAdamW, ahead=1)


def port_betas() -> Case:
    return _port("port_betas", betas=(0.9, 0.95))


def port_eps() -> Case:
    return _port("port_eps", eps=1e-7)


def port_lr_norm_exempt() -> Case:
    return _port("port_lr_norm_exempt", _is_bias_or_norm, lr=2 * LR)


def port_own_adamw_betas() -> Case:
    return _port("port_own_adamw_betas", optimizer=OwnAdamW, betas=(0.9, 0.95))


def port_stale_scale() -> Case:
    return _port("port_stale_scale", stale_scale=True)
