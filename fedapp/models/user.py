"""A user's own PyTorch model: run-config ``model = "module.path:factory"``.

``factory(input_shape, num_classes)`` returns an ``nn.Module`` taking a batch of inputs of ``input_shape`` (without the
batch dimension) to ``num_classes`` logits. The module is imported like any Python module: from the app folder that
``flwr run`` ships (its root is on ``sys.path`` in every Flower process), from the folder the launcher runs in, or from
an installed package. :func:`user_model_problem` checks everything that can be checked before a run starts, each
problem naming run-config 'model': the import, the factory's result, the output shape on a dummy batch, and Opacus'
``ModuleValidator`` (a model it would have to change, e.g. BatchNorm → GroupNorm, is refused with what
``ModuleValidator.fix`` would change: the user's model is never changed silently).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

SEPARATOR = ":"


def is_user_model(name: str) -> bool:
    """Whether run-config 'model' names a user's factory (``module.path:factory``) rather than a catalog model."""
    return SEPARATOR in name


def load_factory(spec: str) -> Callable[..., Any]:
    """The factory ``spec`` names; ``ValueError`` saying what failed (the import, the attribute, not callable)."""
    module_name, _, attr = spec.partition(SEPARATOR)
    if not module_name or not attr:
        raise ValueError(f"{spec!r} is not 'module.path:factory'")
    if "" not in sys.path and "." not in sys.path:
        sys.path.append("")  # the folder the launcher or the app runs in, as `python -m` would have it
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 — any import failure is the user's module's, reported as such
        raise ValueError(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc}); it must be importable "
                         "from the app folder or an installed package") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable")
    return factory  # type: ignore[no-any-return]


def build_user_model(spec: str, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """``factory(input_shape, num_classes)``, checked to be an ``nn.Module`` (``ValueError`` otherwise)."""
    from torch import nn

    try:
        model = load_factory(spec)(tuple(input_shape), int(num_classes))
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 — the factory is the user's code
        raise ValueError(f"{spec}({tuple(input_shape)}, {num_classes}) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec}({tuple(input_shape)}, {num_classes}) returned a {type(model).__name__}, not an "
                         "nn.Module")
    return model


def checked_user_model(spec: str, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """:func:`build_user_model`, whose output on a dummy batch of two is checked to be (2, num_classes) logits
    (``ValueError`` saying what failed); returned in training mode."""
    import torch

    model = build_user_model(spec, input_shape, num_classes)
    try:
        with torch.no_grad():
            out = model.eval()(torch.zeros((2, *input_shape), device="cpu"))  # a fresh CPU model
    except Exception as exc:  # noqa: BLE001 — the forward pass is the user's code
        raise ValueError(f"a dummy batch of shape {(2, *input_shape)} fails in its forward pass "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"a dummy batch of shape {(2, *input_shape)} gives output {got}, expected (2, {num_classes}) "
                         "logits")
    return model.train()


def user_model_problem(spec: str, input_shape: tuple[int, ...], num_classes: int, *, dp_sgd: bool) -> str | None:
    """Why the user's model ``spec`` cannot run on inputs of ``input_shape`` with ``num_classes`` (None when it can):
    :func:`checked_user_model` fails, or (``dp_sgd``: the record-level DP-SGD families, whose per-sample gradients
    Opacus computes) Opacus' ``ModuleValidator`` finds layers it cannot train privately (named with what
    ``ModuleValidator.fix`` would replace them by)."""
    try:
        model = checked_user_model(spec, input_shape, num_classes)
    except ValueError as exc:
        return str(exc)
    return opacus_problem(model) if dp_sgd else None


def opacus_problem(model: Any) -> str | None:
    """Opacus' ``ModuleValidator`` errors for ``model``, with the replacements ``ModuleValidator.fix`` would make."""
    import copy

    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return None
    before = {name: type(m).__name__ for name, m in model.named_modules()}
    try:
        fixed = ModuleValidator.fix(copy.deepcopy(model))
        after = {name: type(m).__name__ for name, m in fixed.named_modules()}
        changes = sorted({f"{before[n]} -> {after[n]}" for n in before if n in after and before[n] != after[n]})
    except Exception:  # noqa: BLE001 — a model Opacus cannot fix either
        changes = []
    found = "; ".join(sorted({str(e).splitlines()[0] for e in errors}))
    fix = (f"ModuleValidator.fix would change {', '.join(changes)}" if changes
           else "ModuleValidator.fix cannot repair it")
    return (f"Opacus cannot train it with per-sample gradients ({found}); {fix}: change the model yourself (this "
            "project never changes a user's model silently)")
