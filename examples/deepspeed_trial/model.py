"""The network and data of the DeepSpeedTrial example, free of Determined so they test anywhere."""

from __future__ import annotations

from typing import Any

import torch


class Regressor(torch.nn.Module):
    """A small MLP learning a fixed random linear map."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.body = torch.nn.Sequential(*layers, torch.nn.Linear(width, width))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.body(inputs)
        return output


class SyntheticRegression(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Inputs and targets of a fixed random linear map; the same for a given seed."""

    def __init__(self, size: int, width: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, width, generator=generator)
        weight = torch.randn(width, width, generator=generator) / width**0.5
        self.targets = self.inputs @ weight

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


def in_engine_precision(engine: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch in the engine's precision: with fp16 or bf16 on, DeepSpeed casts the model's
    weights, not its inputs (unless the config's ``auto_cast``), so float32 inputs fail."""
    dtype = next(engine.module.parameters()).dtype
    inputs, targets = batch
    return inputs.to(dtype), targets.to(dtype)


def train_step(engine: Any, batch: Any) -> torch.Tensor:
    """One optimizer step (the trial's ``train_batch``); the loss."""
    inputs, targets = in_engine_precision(engine, batch)
    loss = torch.nn.functional.mse_loss(engine(inputs), targets)
    engine.backward(loss)
    engine.step()
    return loss


def validation_loss(engine: Any, batch: Any) -> torch.Tensor:
    inputs, targets = in_engine_precision(engine, batch)
    return torch.nn.functional.mse_loss(engine(inputs), targets)
