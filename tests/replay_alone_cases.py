"""Tiny pairs for what replay judges of a module's call alone (tests/test_replay_alone.py):
a GPT-like model whose output head is ``x @ self.tok.weight.T`` in the root's own code,
modules holding sparse, complex and bool buffers, and a block whose port output drops the
reference's leading axis of size 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerdiff import Case

VOCAB, DIM, TOKENS = 16, 8, 6


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(3))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _ScaledEmbedding(nn.Embedding):
    """The planted bug: the looked-up rows scaled by 1.01."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * 1.01


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 1.01


class _GradScaledEmbedding(nn.Embedding):
    """The planted backward bug: the lookup's gradient into the table scaled by 1.01 (the
    head's use of the table, in the root's code, is right)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, _ScaleGrad.apply(self.weight))


class TinyGPT(nn.Module):
    """The head is the token embedding's weight, used in the root's own code."""

    def __init__(self, bug: str = "") -> None:
        super().__init__()
        self.tok = {"": nn.Embedding, "forward": _ScaledEmbedding,
                    "backward": _GradScaledEmbedding}[bug](VOCAB, DIM)
        self.block = _Block()
        self.norm = nn.LayerNorm(DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.block(self.tok(idx)))
        return x @ self.tok.weight.T


def _gpt(bug: str = "") -> Case:
    torch.manual_seed(0)
    targets = torch.randint(0, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(4))
    return Case(model=TinyGPT(bug), inputs=(_tokens(),), seed=0,
                loss_fn=lambda logits: F.cross_entropy(logits.reshape(-1, VOCAB),
                                                       targets.reshape(-1)))


def gpt() -> Case:
    return _gpt()


def gpt_bug_embedding() -> Case:
    return _gpt(bug="forward")


def gpt_bug_embedding_backward() -> Case:
    return _gpt(bug="backward")


class WithBuffers(nn.Module):
    """Buffers of three layouts and kinds: an adjacency (sparse, or dense), a complex phase
    and a bool mask, each used by the forward. The phase and the mask are not part of the
    state (``persistent=False``): the port keeps its own, so a wrong one shows."""

    def __init__(self, sparse: bool = True, shift: float = 0.0, flip: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        eye = torch.eye(DIM)
        adjacency = eye + eye.roll(1, 0)
        self.register_buffer("adjacency", adjacency.to_sparse() if sparse else adjacency)
        angles = torch.linspace(0, 1, DIM) + shift
        self.register_buffer("phase", torch.polar(torch.ones(DIM), angles), persistent=False)
        keep = torch.arange(DIM) % 3 != 0
        self.register_buffer("keep", ~keep if flip else keep, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).T
        y = (torch.sparse.mm(self.adjacency, y) if self.adjacency.is_sparse
             else self.adjacency @ y).T
        y = y * self.phase.real.to(y.dtype)
        return torch.where(self.keep, y, torch.zeros_like(y))


class BufferModel(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.inner = WithBuffers(**options)
        self.out = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def _buffers(**options) -> Case:
    torch.manual_seed(0)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(1))
    return Case(model=BufferModel(**options), inputs=(x,), seed=0,
                loss_fn=lambda out: out.square().mean())


def buffers() -> Case:
    """Both sides hold the adjacency sparse: the trace keeps its layout, shape and dtype."""
    return _buffers()


def buffers_dense() -> Case:
    """A reference that holds the adjacency dense, for a port that holds it sparse."""
    return _buffers(sparse=False)


def buffers_bug_phase() -> Case:
    return _buffers(shift=0.1)


def buffers_bug_keep() -> Case:
    return _buffers(flip=True)


class _SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)  # its gradient is sparse
        self.fc = nn.Linear(DIM, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx))


def sparse_gradient() -> Case:
    torch.manual_seed(0)
    return Case(model=_SparseLookup(), inputs=(_tokens(),), seed=0,
                loss_fn=lambda out: out.square().mean())


class _Mix(nn.Module):
    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x)) * self.scale
        return y[0] if self.squeeze else y   # (T, D) in the port, (1, T, D) in the reference


class _Unit(nn.Module):
    def __init__(self, squeeze: bool) -> None:
        super().__init__()
        self.mix = _Mix(squeeze)
        self.head = nn.Linear(DIM, 3)
        self.squeeze = squeeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(x)).reshape(TOKENS, 3)


def _unit(squeeze: bool) -> Case:
    torch.manual_seed(0)
    x = torch.randn(1, TOKENS, DIM, generator=torch.Generator().manual_seed(2))
    return Case(model=_Unit(squeeze), inputs=(x,), seed=0,
                loss_fn=lambda out: out.square().mean())


def unit_reference() -> Case:
    return _unit(squeeze=False)


def unit_port() -> Case:
    return _unit(squeeze=True)


# ---- a real pair: transformers' GPT2LMHeadModel (its head an nn.Linear tied to wte) against
# a nanoGPT port whose head is the embedding's weight in the root's own code

def _head_in_root_gpt():
    from tests import gpt_cases

    class HeadInRootGPT(gpt_cases.GPT):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            del self.lm_head  # wte keeps the tied weight; the head is the root's own matmul

        def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
            pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
            x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
            for block in self.transformer.h:
                x = block(x)
            return self.transformer.ln_f(x) @ self.transformer.wte.weight.T, None

    return gpt_cases._build(HeadInRootGPT, f"{__name__}:gpt2_head_in_root")


def gpt2_head_in_root() -> Case:
    return _head_in_root_gpt()


def gpt2_head_in_root_bug_lookup_grad() -> Case:
    """The embedding's lookup sends 1.01x the right gradient into its table."""
    case = _head_in_root_gpt()
    wte = case.model.transformer.wte
    wte.forward = lambda idx: F.embedding(idx, _ScaleGrad.apply(wte.weight))
    return case


def gpt2_head_in_root_bug_gelu_backward() -> Case:
    from tests import gpt_cases

    case = _head_in_root_gpt()
    case.model.transformer.h[1].mlp.gelu = gpt_cases.CustomGELU()
    return case


def same(tensor):
    """A conversion that changes nothing: a mapping rule naming it still stands between the
    two sides' tensors (tests/test_replay_alone.py)."""
    return tensor
