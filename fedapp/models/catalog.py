"""The model zoo's names, the inputs each model takes and per-model DP-SGD facts, without importing torch (config
checks and the launcher read them; the classes are in :mod:`fedapp.models.zoo`)."""

from __future__ import annotations

from dataclasses import dataclass

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

A9A_FEATURES = 123
#: the shape of one example (without the batch dimension) of every named dataset, known before loading it: the
#: run-config check matches it against the model's inputs (``tests/unit/fedapp/config/test_config.py`` checks it against
#: the loaders)
INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "digits": (1, 8, 8),
    "mnist": (1, 28, 28),
    "fmnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "cifar100": (3, 32, 32),
    "a9a": (A9A_FEATURES,),
}

#: the classes of every named dataset (``tests/unit/fedapp/models/test_user_model.py`` checks it against the loaders)
NUM_CLASSES: dict[str, int] = {"digits": 10, "mnist": 10, "fmnist": 10, "cifar10": 10, "cifar100": 100, "a9a": 2}

GRAD_SAMPLE_MODES: tuple[str, ...] = ("hooks", "ew", "functorch", "bk")
"""Per-sample gradient modes ``fedapp.clients.training`` runs: Opacus' ``hooks``, ``ew`` and ``functorch``, and ``bk``
(book-keeping with mixed ghost norms, :mod:`fedapp.clients.book_keeping`). Opacus' ``ghost`` needs a wrapped criterion
and a second backward pass: not run."""

UNSUPPORTED_GRAD_SAMPLE_MODES: dict[tuple[str, str], str] = {}
"""(model, mode) pairs that cannot train with DP-SGD, with the reason; ``tests/unit/fedapp/models/test_dp_models.py``
keeps it honest (every pair not listed runs one real private step)."""


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


# ---------------------------------------------------------------------------------------------- model inputs
#: the spatial layers of each image model (:mod:`fedapp.models.zoo`), in order: ("conv"|"pool", kernel, stride,
#: padding), and the height/width the last one must leave for the first ``nn.Linear`` (None: any, the model
#: pools adaptively). Channels are free: every model takes its input channels from the data.
_IMAGE_LAYERS: dict[str, tuple[tuple[tuple[str, int, int, int], ...], int | None]] = {
    "cnn-mnist": ((("conv", 5, 1, 2), ("pool", 2, 2, 0)) * 2, 7),
    "cnn-fmnist": ((("conv", 5, 1, 2), ("pool", 2, 2, 0)) * 2, 7),
    "cnn-cifar": ((("conv", 3, 1, 0), ("pool", 2, 2, 0)) * 3, 2),
    "cnn-digits": ((("conv", 3, 1, 1), ("pool", 2, 2, 0)) * 2, 2),
    "resnet18-gn": ((("conv", 7, 2, 3), ("pool", 3, 2, 1)) + (("conv", 3, 2, 1),) * 3, None),
}
#: models that flatten whatever they get (their first layer is sized from the data)
FLAT_INPUT_MODELS: tuple[str, ...] = ("mlp-sigmoid", "mlp-digits", "logreg")


def _spatial_out(size: int, layers: tuple[tuple[str, int, int, int], ...]) -> int | None:
    """Height (or width) after ``layers`` (floor((x + 2p − k)/s) + 1 each), None once a layer gets less than its
    kernel."""
    for _, kernel, stride, padding in layers:
        if size + 2 * padding < kernel:
            return None
        size = (size + 2 * padding - kernel) // stride + 1
    return size


def model_input_problem(model_name: str, input_shape: tuple[int, ...]) -> str | None:
    """Why model ``model_name`` cannot take inputs of ``input_shape`` (without the batch dimension), or None when
    it can. Decided from the architecture alone (no torch, no data), so the run-config check can refuse a
    model/dataset pair before anything is loaded; ``tests/unit/fedapp/config/test_config.py`` compares every verdict
    with a real forward pass."""
    if model_name not in MODEL_NAMES:
        return f"unknown model {model_name!r}; valid: {sorted(MODEL_NAMES)}"
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d <= 0 for d in shape):
        return f"inputs of shape {shape} are empty"
    if model_name in FLAT_INPUT_MODELS:
        return None
    layers, final = _IMAGE_LAYERS[model_name]
    if len(shape) != 3:
        return f"it needs image inputs (C, H, W), got shape {shape}"
    _, height, width = shape
    out = (_spatial_out(height, layers), _spatial_out(width, layers))
    if None in out:
        return f"its convolutions and poolings need larger images than {height}×{width}"
    if final is not None and out != (final, final):
        sizes = [s for s in range(1, 1025) if _spatial_out(s, layers) == final]
        fits = f"{sizes[0]}×{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]} pixels a side"
        return f"it is built for images of {fits} (its last feature maps must be {final}×{final}), got {height}×{width}"
    return None


def check_model_input(model_name: str, input_shape: tuple[int, ...]) -> None:
    """Raise ``ValueError`` naming the model and the shape when :func:`model_input_problem` finds one."""
    problem = model_input_problem(model_name, input_shape)
    if problem is not None:
        raise ValueError(f"model {model_name!r} does not fit inputs of shape {tuple(input_shape)}: {problem}")


@dataclass(frozen=True)
class ModelSpec:
    """The run's model: a catalog name (``model``, with ``auto`` resolved for the dataset), the seed its initial
    weights are drawn from (identical on the server and every client) and SoteriaFL's nonconvex regularizer λ."""

    name: str
    seed: int
    nonconvex_lambda: float = 0.0
