"""Evaluation and checks of a user's model and loss (the library's clients and the server's evaluation)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from fedapp.data.datasets import ArrayDataset
from fedapp.models.user import opacus_problem

#: a batch loss: (model outputs, labels) → a scalar tensor, the mean over the batch's records
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModelProblem(ValueError):
    """The user's model or loss cannot be trained as asked; the message says what is wrong and how to fix it."""


@torch.no_grad()
def evaluate_user_model(model: nn.Module, data: ArrayDataset, loss: Loss | None, batch_size: int,
                        device: torch.device) -> tuple[float, float | None]:
    """(mean loss per record, accuracy or None) of ``model`` on ``data``; accuracy when the outputs are [N, k] class
    scores and the labels integers."""
    loss_fn = loss if loss is not None else nn.CrossEntropyLoss()
    model.to(device).eval()
    total, correct, classify = 0.0, 0, data.y.dtype.kind == "i"
    for start in range(0, len(data), batch_size):
        xb = torch.tensor(data.x[start:start + batch_size], device=device)
        yb = torch.tensor(data.y[start:start + batch_size], device=device)
        out = model(xb)
        total += float(loss_fn(out, yb)) * len(yb)
        classify = classify and out.dim() == 2
        if classify:
            correct += int((out.argmax(1) == yb).sum())
    model.train()
    return total / max(len(data), 1), (correct / len(data) if classify and len(data) else None)


def _check_book_keeping(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss | None) -> None:
    """One book-keeping clipped sum on a copy of ``model``: a layer it has no rule for, a layer run twice or an output
    changed in place raises :class:`ModelProblem` with the reason."""
    from fedapp.clients.book_keeping import BookKeeping

    copied = copy.deepcopy(model).train()
    try:
        book_keeping = BookKeeping(copied)
        try:
            book_keeping.clipped_sum((loss if loss is not None else nn.CrossEntropyLoss())(copied(x), y), 1.0)
        finally:
            book_keeping.close()
    except ValueError as exc:
        raise ModelProblem(f"model {type(model).__name__}: {exc}") from None


def check_model(model: object, data: ArrayDataset, loss: Loss | None, *, per_sample: bool,
                book_keeping: bool = False) -> nn.Module:
    """``model`` checked before any round: an ``nn.Module`` whose forward pass takes two of ``data``'s records and
    whose output ``loss`` (None: cross-entropy, which needs [2, k] scores with k above every label) turns into a scalar;
    with ``per_sample`` (DP-SGD) Opacus must be able to compute its per-sample gradients and the loss must average over
    the batch; with ``book_keeping`` (``grad_sample_mode = "bk"``) one book-keeping step must run on a copy of it
    (:mod:`fedapp.clients.book_keeping`). Raises :class:`ModelProblem` naming the first problem found; the model is
    never changed."""
    if not isinstance(model, nn.Module):
        raise ModelProblem(f"model is a {type(model).__name__}, not a torch.nn.Module")
    reduction = getattr(loss, "reduction", "mean")
    if per_sample and reduction != "mean":
        raise ModelProblem(f"loss has reduction = {reduction!r}; DP-SGD needs the batch mean of per-sample losses "
                           "(reduction='mean'): Opacus scales per-sample gradients for it")
    if per_sample:
        problem = opacus_problem(model)
        if problem is not None:
            raise ModelProblem(f"model {type(model).__name__}: {problem}")
    x = torch.as_tensor(data.x[:2])
    y = torch.as_tensor(data.y[:2])
    was_training = model.training
    try:
        with torch.no_grad():
            out = model.eval()(x)
            value = (loss if loss is not None else nn.CrossEntropyLoss())(out, y)
    except Exception as exc:  # noqa: BLE001 — the forward pass and the loss are the user's code
        raise ModelProblem(f"model {type(model).__name__} on a batch of inputs of shape {tuple(x.shape)} with labels "
                           f"{tuple(y.shape)} {y.dtype} fails in its forward pass or loss ({type(exc).__name__}: {exc})"
                           ) from None
    finally:
        model.train(was_training)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise ModelProblem(f"the loss of model {type(model).__name__}'s output {tuple(out.shape)} is not a scalar "
                           "tensor; it must be the batch mean")
    if book_keeping:
        _check_book_keeping(model, x, y, loss)
    if loss is None and (out.dim() != 2 or out.shape[1] <= int(data.y.max())):
        raise ModelProblem(f"model {type(model).__name__} outputs {tuple(out.shape)} for 2 records; cross-entropy needs "
                           f"[2, k] class scores with k > {int(data.y.max())}, the largest training label")
    return model
