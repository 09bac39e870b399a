"""The model zoo's names and per-model DP-SGD facts, without importing torch (config checks and the
launcher read them; the classes are in :mod:`fedapp.models`)."""

from __future__ import annotations

MODEL_NAMES: tuple[str, ...] = ("cnn-mnist", "cnn-fmnist", "cnn-cifar", "mlp-sigmoid", "logreg", "resnet18-gn",
                                "cnn-digits", "mlp-digits")

DEFAULT_MODEL: dict[str, str] = {
    "digits": "cnn-digits",
    "mnist": "cnn-mnist",
    "fmnist": "cnn-mnist",
    "cifar10": "cnn-cifar",
    "cifar100": "resnet18-gn",
    "a9a": "logreg",
}

GRAD_SAMPLE_MODES: tuple[str, ...] = ("hooks", "ew", "functorch")
"""Opacus per-sample gradient modes ``fedapp.training`` runs (Opacus' ``ghost`` needs a wrapped criterion: not run)."""

UNSUPPORTED_GRAD_SAMPLE_MODES: dict[tuple[str, str], str] = {}
"""(model, mode) pairs that cannot train with DP-SGD, with the reason; ``tests/test_dp_models.py`` keeps it honest
(every pair not listed runs one real private step)."""


def check_grad_sample_mode(model_name: str, mode: str) -> None:
    """Raise ``ValueError`` naming both when Opacus grad-sample ``mode`` cannot train model ``model_name``."""
    if model_name not in MODEL_NAMES:
        raise ValueError(f"unknown model {model_name!r}; valid: {sorted(MODEL_NAMES)}")
    if mode not in GRAD_SAMPLE_MODES:
        raise ValueError(f"grad-sample-mode {mode!r} is not supported (model {model_name!r}); "
                         f"valid: {list(GRAD_SAMPLE_MODES)}")
    reason = UNSUPPORTED_GRAD_SAMPLE_MODES.get((model_name, mode))
    if reason is not None:
        raise ValueError(f"model {model_name!r} cannot train with grad-sample-mode {mode!r}: {reason}")
