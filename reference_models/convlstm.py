"""A ConvLSTM that predicts the next frame of a moving blob, trained with gradient clipping.

One ConvLSTM cell (a single 3x3 convolution computes the four gates from the frame and the
hidden state) runs over the frames; a 1x1 convolution reads each hidden state out into the
predicted next frame. The cell is called once per frame: sites ``cell#0`` .. ``cell#T-1``.
Its port is pure numpy (``convlstm_numpy``), forward and backward written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0


@dataclass(frozen=True)
class Config:
    batch: int = 4
    frames: int = 6
    channels: int = 1
    hidden: int = 8
    size: int = 12
    kernel: int = 3
    clip: float = 0.5
    lr: float = 0.1
    steps: int = 3


class ConvLSTMCell(nn.Module):
    def __init__(self, channels: int, hidden: int, kernel: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels + hidden, 4 * hidden, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor, h: torch.Tensor,
                c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, f, g, o = self.conv(torch.cat([x, h], dim=1)).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c


class ConvLSTM(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.hidden = cfg.hidden
        self.cell = ConvLSTMCell(cfg.channels, cfg.hidden, cfg.kernel)
        self.head = nn.Conv2d(cfg.hidden, cfg.channels, 1)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """(batch, time, channels, height, width) -> the predicted next frame at every step."""
        batch, time, _, height, width = frames.shape
        h = c = frames.new_zeros(batch, self.hidden, height, width)
        predictions = []
        for t in range(time):
            h, c = self.cell(frames[:, t], h, c)
            predictions.append(self.head(h))
        return torch.stack(predictions, dim=1)


def make_frames(cfg: Config) -> torch.Tensor:
    """Gaussian blobs moving at constant velocity: (batch, frames + 1, channels, size, size)."""
    start = torch.rand(cfg.batch, 2) * (cfg.size - 1)
    velocity = torch.rand(cfg.batch, 2) * 2 - 1
    grid = torch.arange(cfg.size, dtype=torch.float32)
    times = torch.arange(cfg.frames + 1, dtype=torch.float32)
    centre = start[:, None, :] + times[None, :, None] * velocity[:, None, :]  # (b, t, 2)
    dy = grid.view(1, 1, -1, 1) - centre[..., 0, None, None]
    dx = grid.view(1, 1, 1, -1) - centre[..., 1, None, None]
    blob = torch.exp(-(dy**2 + dx**2) / 3.0)
    return blob.unsqueeze(2).expand(-1, -1, cfg.channels, -1, -1).contiguous()


def setup(cfg: Config) -> tuple[ConvLSTM, torch.Tensor, torch.Tensor]:
    """The seeded model, its input frames and the next frames it should predict."""
    seed_everything(SEED)
    model = ConvLSTM(cfg)
    frames = make_frames(cfg)
    return model, frames[:, :-1], frames[:, 1:]


def build(cfg: Config, name: str) -> Case:
    model, inputs, targets = setup(cfg)
    return Case(model=model, inputs=(inputs,),
                loss_fn=lambda predicted: F.mse_loss(predicted, targets),
                seed=SEED, steps=cfg.steps, clip_grad_norm=cfg.clip,
                optimizer=lambda params: torch.optim.SGD(params, lr=cfg.lr), name=name)


def reference() -> Case:
    """Batch 4, 6 frames of 12x12, 8 hidden channels; 3 SGD steps with clipping at 0.5."""
    return build(Config(), "reference_models.convlstm:reference")
