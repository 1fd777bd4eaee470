"""Example PyTorch modules for ``model=torch`` (``model.torch_class``), same shapes as the
built-in models. Importing this module needs torch; nothing else in the pipeline does."""
from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Conv(1->8) -> ReLU -> MaxPool -> Conv(8->16) -> ReLU -> MaxPool -> Linear head."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, size: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * (size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class DigitsMLP(nn.Module):
    def __init__(self, in_features: int = 64, hidden: int = 64, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(torch.flatten(x, 1))))
