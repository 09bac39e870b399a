"""secaggmodel: the model and data (yours to replace), as in the template's task.py."""

from __future__ import annotations

import torch
from sklearn.datasets import make_classification
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_FEATURES, NUM_CLASSES = 12, 4


class Net(nn.Module):
    """A small MLP with LayerNorm: client-level DP clips whole updates, so any model that trains with SGD will do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(NUM_FEATURES, 32), nn.LayerNorm(32), nn.Tanh())
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _pool() -> tuple[torch.Tensor, torch.Tensor]:
    """2,000 synthetic records (scikit-learn's make_classification, fixed seed): the same on every node."""
    x, y = make_classification(n_samples=2000, n_features=NUM_FEATURES, n_informative=8, n_classes=NUM_CLASSES,
                               class_sep=2.0, random_state=7)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)


def load_data(partition_id: int, num_partitions: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """This client's share of the first 1,600 records, 80 % to train on and 20 % to test on."""
    x, y = _pool()
    part = torch.arange(1600)[partition_id::num_partitions]  # a fixed iid split, no record in two partitions
    cut = int(0.8 * len(part))
    train = TensorDataset(x[part[:cut]], y[part[:cut]])
    test = TensorDataset(x[part[cut:]], y[part[cut:]])
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(test, batch_size=batch_size)


def load_centralized_test() -> TensorDataset:
    """The last 400 records, held out for the server's evaluation of the global model."""
    x, y = _pool()
    return TensorDataset(x[1600:], y[1600:])
