"""Model zoo: the papers' architectures plus small variants for 8x8 digits.

Every model is Opacus-compatible in every grad-sample mode (no BatchNorm, no in-place ops; ResNet-18 uses
GroupNorm) — ``tests/unit/fedapp/models/test_dp_models.py`` takes one real private step per (model x mode).
Parameter counts are checked in ``tests/integration/fedapp/models/test_models.py`` against the papers.

A model class whose ``CPU_MEMORY_FORMAT`` is ``torch.channels_last`` trains (without per-sample gradients) and
evaluates faster on a CPU in that layout, oneDNN's convolutions: 0.62-0.79x the CPU time of a plain-SGD step and
0.49-0.63x of an evaluation pass for the three 28/32-pixel CNNs (0.96x and 0.57x for the 8x8 digits CNN), where the
GroupNorm ResNet takes 1.16x and keeps the default (``python -m benchmarks.memory_format``, docs/benchmarks.md).
:mod:`fedapp.clients.training` switches the layout around its loops only; weights leave them contiguous.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedapp.models.catalog import (  # noqa: F401 — the names, torch-free, re-exported
    DEFAULT_MODEL,
    GRAD_SAMPLE_MODES,
    MODEL_NAMES,
    UNSUPPORTED_GRAD_SAMPLE_MODES,
    check_grad_sample_mode,
    model_input_problem,
)
from fedapp.models.user import checked_user_model, is_user_model
from strategies.errors import ConfigError


class MnistCNN(nn.Module):
    """Robust-HDP Table 5 CNN for MNIST/FMNIST: 28,938 parameters."""

    CPU_MEMORY_FORMAT = torch.channels_last  # faster on a CPU (module docstring)

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


class FmnistCNN(nn.Module):
    """Fed-SMP Sec. 6.1 FMNIST CNN (McMahan et al. 2017): conv5x5(32)-pool-conv5x5(64)-pool-fc512-fc10, ~1.66M params."""

    CPU_MEMORY_FORMAT = torch.channels_last  # faster on a CPU (module docstring)

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.body = nn.Sequential(nn.Linear(64 * 7 * 7, 512), nn.ReLU())
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(torch.flatten(self.features(x), 1)))


class CifarCNN(nn.Module):
    """DP2-FedSAM Sec. 5.1 CIFAR-10 CNN: three valid 3x3 convs (64,128,256) each + pool, fc256-fc128-fc10; 667,402 params."""

    CPU_MEMORY_FORMAT = torch.channels_last  # faster on a CPU (module docstring)

    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(64, 128, 3), nn.MaxPool2d(2), nn.ReLU(),
            nn.Conv2d(128, 256, 3), nn.MaxPool2d(2), nn.ReLU(),
        )
        self.body = nn.Sequential(nn.Linear(256 * 2 * 2, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU())
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(torch.flatten(self.features(x), 1)))


class SigmoidMLP(nn.Module):
    """SoteriaFL Sec. 6 MLP: in-hidden-out with sigmoid hidden activation (784-64-10 on MNIST)."""

    def __init__(self, in_features: int = 784, hidden: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.Sigmoid())
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


class LogisticRegression(nn.Module):
    """Logistic regression; binary (one logit) when ``num_classes == 2``.

    ``nonconvex_lambda > 0`` adds SoteriaFL's nonconvex regularizer
    λ Σ_j x_j² / (1 + x_j²) (SoteriaFL Sec. 6) through :meth:`regularization`.
    """

    def __init__(self, in_features: int, num_classes: int = 2, nonconvex_lambda: float = 0.0) -> None:
        super().__init__()
        self.binary = num_classes == 2
        self.fc = nn.Linear(in_features, 1 if self.binary else num_classes)
        self.nonconvex_lambda = float(nonconvex_lambda)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(torch.flatten(x, 1))
        if self.binary:  # two logits [0, z] so cross-entropy equals the logistic loss
            out = torch.cat([torch.zeros_like(out), out], dim=1)
        return out

    def regularization(self) -> torch.Tensor:
        if self.nonconvex_lambda == 0.0:
            return torch.zeros((), device=self.fc.weight.device)
        w = torch.cat([p.reshape(-1) for p in self.parameters()])
        return self.nonconvex_lambda * torch.sum(w**2 / (1.0 + w**2))


class DigitsCNN(nn.Module):
    """Small CNN for 8x8 digits (same shape family as Table 5, scaled down): 6,058 params."""

    CPU_MEMORY_FORMAT = torch.channels_last  # faster on a CPU (module docstring)

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.body = nn.Sequential(nn.Linear(16 * 2 * 2, 64), nn.ReLU())
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(torch.flatten(self.features(x), 1)))


class ResidualBlock(nn.Module):
    """torchvision's ``BasicBlock`` without in-place ops, with its submodules' names and order (so the same
    ``state_dict``): conv3x3(stride) → norm → ReLU → conv3x3 → norm, plus the identity (or ``downsample``), ReLU.

    Opacus' ``hooks`` and ``functorch`` modes wrap module outputs in backward hooks; torchvision's in-place
    ``ReLU(inplace=True)`` and ``out += identity`` modify those outputs ("Output 0 of BackwardHookFunction is
    a view and is being modified inplace"). Same math, same parameters.
    """

    def __init__(self, in_channels: int, channels: int, norm: Callable[[int], nn.Module], stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = norm(channels)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet18GN(nn.Module):
    """torchvision's ``resnet18`` (He et al. 2016, ImageNet stem) with GroupNorm and no in-place ops, written out
    so torchvision is not needed: the same modules in the same order, so the same ``state_dict`` keys (norms keep
    torchvision's ``bn*`` / ``downsample.1`` names) and, for 3 input channels under the same seed, the same
    initial weights (modules are created, and the random initialization drawn, in torchvision's order)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, groups: int = 32) -> None:
        super().__init__()

        def norm(channels: int) -> nn.Module:
            return nn.GroupNorm(min(groups, channels), channels)

        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._layer(64, 64, 1, norm)
        self.layer2 = self._layer(64, 128, 2, norm)
        self.layer3 = self._layer(128, 256, 2, norm)
        self.layer4 = self._layer(256, 512, 2, norm)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)  # PyTorch's default Linear init, as torchvision leaves it
        for m in self.modules():  # torchvision's initialization (zero_init_residual=False)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.GroupNorm):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    @staticmethod
    def _layer(in_channels: int, channels: int, stride: int, norm: Callable[[int], nn.Module]) -> nn.Sequential:
        downsample = None
        if stride != 1 or in_channels != channels:  # created before the blocks, as torchvision's _make_layer does
            downsample = nn.Sequential(nn.Conv2d(in_channels, channels, kernel_size=1, stride=stride, bias=False),
                                       norm(channels))
        return nn.Sequential(ResidualBlock(in_channels, channels, norm, stride, downsample),
                             ResidualBlock(channels, channels, norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_groupnorm(in_channels: int = 3, num_classes: int = 10, groups: int = 32) -> nn.Module:
    """ResNet-18 with GroupNorm and no in-place ops (Opacus, every grad-sample mode): 11,181,642 params
    for 3 input channels and 10 classes (:class:`ResNet18GN`)."""
    return ResNet18GN(in_channels, num_classes, groups)


ModelFactory = Callable[..., nn.Module]

MODELS: dict[str, ModelFactory] = {  # keys: fedapp.models.catalog.MODEL_NAMES (a test checks they agree)
    "cnn-mnist": MnistCNN,
    "cnn-fmnist": FmnistCNN,
    "cnn-cifar": CifarCNN,
    "mlp-sigmoid": SigmoidMLP,
    "logreg": LogisticRegression,
    "resnet18-gn": resnet18_groupnorm,
    "cnn-digits": DigitsCNN,
    "mlp-digits": SigmoidMLP,
}

def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, *, nonconvex_lambda: float = 0.0) -> nn.Module:
    """Instantiate model ``name`` for inputs of ``input_shape`` (without batch) and ``num_classes``.

    A model that cannot take such inputs (:func:`fedapp.models.catalog.model_input_problem`) raises a
    ``ConfigError`` (a ``ValueError``) naming run-config 'model' — the data's shape is only known here for
    ``hf:`` datasets; the run-config check refuses the pair for every named dataset before any data is loaded."""
    if is_user_model(name):  # a user's factory, built once; its shapes are checked on a dummy batch
        try:
            return checked_user_model(name, tuple(input_shape), num_classes)
        except ValueError as exc:
            raise ConfigError(f"run-config 'model' = {name!r}: {exc}") from None
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {sorted(MODELS)}")
    problem = model_input_problem(name, tuple(input_shape))
    if problem is not None:
        raise ConfigError(f"run-config 'model' = {name!r} does not fit the dataset's inputs of shape "
                          f"{tuple(input_shape)}: {problem}")
    if name in ("mlp-sigmoid", "mlp-digits"):
        features = 1
        for d in input_shape:
            features *= d
        return SigmoidMLP(features, 64 if name == "mlp-sigmoid" else 32, num_classes)
    if name == "logreg":
        features = 1
        for d in input_shape:
            features *= d
        return LogisticRegression(features, num_classes, nonconvex_lambda)
    return MODELS[name](input_shape[0], num_classes)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
