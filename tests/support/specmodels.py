"""Module-level classes for spec/build tests: importable in a fresh process."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

SENTINEL: list[str] = []
"""Appended to whenever something here is called; hostile tests check it stays empty."""


class Net(nn.Module):
    """A small MLP whose width comes from its spec."""

    def __init__(self, width: int = 8, *, depth: int = 1) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(4, width), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 2))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


class Counter:
    """A plain stateful object (kind "object")."""

    def __init__(self, start: int = 0) -> None:
        self.count = start

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


def train(model: nn.Module, optimizer: Any, scheduler: Any, steps: int, seed: int) -> list[float]:
    """``steps`` deterministic training steps; the losses, for exact comparison."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        loss = (model(x) - x[:, :2]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses
