"""Local training loops: record-level DP-SGD with Opacus, plain SGD, and evaluation.

DP-SGD (Abadi et al. 2016) protects each *record* of a client's dataset against anyone
who sees the client's model updates (local, record-level DP; the server is untrusted).
Opacus clips every per-sample gradient to ``clip`` (c) and adds N(0, c²z²) to their sum;
batches are Poisson-sampled with rate q = 1/⌈N/b⌉ (Opacus' rate for a loader of ⌈N/b⌉
batches), so one epoch is ⌈N/b⌉ steps of the subsampled Gaussian mechanism, exactly what
the accountant composes (Robust-HDP Sec. 3, Eq. 1 and Algorithm 1).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedapp.data import ArrayDataset


def resolve_device(name: str = "auto") -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def get_weights(model: nn.Module) -> list[np.ndarray]:
    """Model state as float32 numpy arrays, in ``state_dict`` order (no Opacus prefixes)."""
    return [v.detach().cpu().numpy().astype(np.float32, copy=True) for v in model.state_dict().values()]


def set_weights(model: nn.Module, weights: list[np.ndarray]) -> None:
    state = model.state_dict()
    if len(weights) != len(state):
        raise ValueError(f"expected {len(state)} arrays, got {len(weights)}")
    new_state = {}
    for (name, old), w in zip(state.items(), weights):
        if tuple(old.shape) != tuple(w.shape):
            raise ValueError(f"array for {name!r} has shape {tuple(w.shape)}, expected {tuple(old.shape)}")
        new_state[name] = torch.as_tensor(np.asarray(w), dtype=old.dtype)
    model.load_state_dict(new_state, strict=True)


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """⌈N/b⌉: DP-SGD steps in one local epoch (Robust-HDP: E_i = K_i·⌈N_i/b_i⌉ per round)."""
    return math.ceil(num_examples / batch_size)


def dpsgd_sample_rate(num_examples: int, batch_size: int) -> float:
    """Poisson sampling rate Opacus uses for a loader of ⌈N/b⌉ batches: q = 1/⌈N/b⌉ (≈ b/N)."""
    return 1.0 / steps_per_epoch(num_examples, batch_size)


@dataclass
class TrainResult:
    steps: int
    loss: float
    seconds: float
    extra: dict = field(default_factory=dict)


def _tensor_dataset(data: ArrayDataset) -> TensorDataset:
    return TensorDataset(torch.from_numpy(data.x), torch.from_numpy(data.y))


def _regularization(model: nn.Module) -> torch.Tensor | None:
    reg = getattr(model, "regularization", None)
    return reg() if callable(reg) else None


def train_plain(model: nn.Module, data: ArrayDataset, *, batch_size: int, epochs: int, lr: float,
                momentum: float = 0.0, device: torch.device | None = None, seed: int = 0) -> TrainResult:
    """Non-private minibatch SGD for ``epochs`` epochs (shuffled, ⌈N/b⌉ steps each)."""
    device = device or torch.device("cpu")
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(_tensor_dataset(data), batch_size=batch_size, shuffle=True, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    start, steps, total = time.perf_counter(), 0, 0.0
    for _ in range(epochs):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            reg = _regularization(model)
            if reg is not None:
                loss = loss + reg
            loss.backward()
            opt.step()
            steps += 1
            total += float(loss.detach())
    return TrainResult(steps, total / max(steps, 1), time.perf_counter() - start)


def train_dp_sgd(model: nn.Module, data: ArrayDataset, *, batch_size: int, epochs: int, lr: float,
                 noise_multiplier: float, clip: float, momentum: float = 0.0,
                 device: torch.device | None = None, seed: int = 0,
                 grad_sample_mode: str = "hooks") -> TrainResult:
    """Opacus DP-SGD for ``epochs`` epochs of ⌈N/b⌉ Poisson-sampled steps each.

    ``model`` is trained in place (its parameters are shared with Opacus' wrapper). The
    returned ``extra["sample_rate"]`` is the q the accountant must compose. Privacy
    accounting is done by the caller (it owns the persistent history).
    """
    from opacus import PrivacyEngine

    device = device or torch.device("cpu")
    model.to(device).train()
    torch.manual_seed(seed)
    loader = DataLoader(_tensor_dataset(data), batch_size=batch_size, shuffle=False)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' secure-RNG notice (secure_mode is a documented option)
        engine = PrivacyEngine(accountant="rdp", secure_mode=False)
        module, optimizer, dp_loader = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=noise_multiplier,
            max_grad_norm=clip, poisson_sampling=True, grad_sample_mode=grad_sample_mode,
        )
    loss_fn = nn.CrossEntropyLoss()
    start, steps, total = time.perf_counter(), 0, 0.0
    for _ in range(epochs):
        for xb, yb in dp_loader:
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad(set_to_none=True)
            if len(yb) == 0:  # empty Poisson batch: Opacus still adds noise on step
                out = module(xb)
                loss = out.sum() * 0.0
            else:
                loss = loss_fn(module(xb), yb)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook")
                loss.backward()
            optimizer.step()
            reg = _regularization(model)
            if reg is not None:  # data-independent term: its gradient costs no privacy
                model.zero_grad(set_to_none=True)
                grads = torch.autograd.grad(reg, [p for p in model.parameters() if p.requires_grad])
                with torch.no_grad():
                    for p, g in zip((p for p in model.parameters() if p.requires_grad), grads):
                        p.add_(g, alpha=-lr)
            steps += 1
            total += float(loss.detach())
    sample_rate = 1.0 / len(loader)
    # remove Opacus hooks so the plain module can be reused/serialized
    if hasattr(module, "_close"):
        module._close()
    return TrainResult(steps, total / max(steps, 1), time.perf_counter() - start, {"sample_rate": sample_rate})


@torch.no_grad()
def evaluate_model(model: nn.Module, data: ArrayDataset, *, batch_size: int = 512,
                   device: torch.device | None = None) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy) of ``model`` on ``data``."""
    if len(data) == 0:
        return float("nan"), float("nan")
    device = device or torch.device("cpu")
    model.to(device).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total_loss, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        xb = torch.from_numpy(data.x[start:start + batch_size]).to(device)
        yb = torch.from_numpy(data.y[start:start + batch_size]).to(device)
        out = model(xb)
        total_loss += float(loss_fn(out, yb))
        correct += int((out.argmax(1) == yb).sum())
    return total_loss / len(data), correct / len(data)
