"""A tiny MLP on synthetic regression data: big enough for DeepSpeed to profile, small for a CPU."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def synthetic_batch(
    batch_size: int, width: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of a fixed random linear function, so the loss can go down."""
    inputs = torch.randn(batch_size, width, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True) / width**0.5
    return inputs, targets
