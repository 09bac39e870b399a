"""The local-training loop of every client (plain SGD, SAM, partial sharing, Opacus DP-SGD) and evaluation.

DP-SGD (Abadi et al. 2016) protects each *record* of a client's dataset against anyone
who sees the client's model updates (local, record-level DP; the server is untrusted).
Opacus clips every per-sample gradient to ``clip`` (c) and adds N(0, c²z²) to their sum;
batches are Poisson-sampled with rate q = 1/⌈N/b⌉ (Opacus' rate for a loader of ⌈N/b⌉
batches), so one epoch is ⌈N/b⌉ steps of the subsampled Gaussian mechanism, exactly what
the accountant composes (Robust-HDP Sec. 3, Eq. 1 and Algorithm 1).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from fedapp.data.datasets import ArrayDataset
from fedapp.privacy.profiles import dpsgd_sample_rate, steps_per_epoch


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


@dataclass
class TrainResult:
    steps: int
    loss: float
    seconds: float
    extra: dict = field(default_factory=dict)


def _regularization(model: nn.Module) -> torch.Tensor | None:
    reg = getattr(model, "regularization", None)
    return reg() if callable(reg) else None


@dataclass(frozen=True)
class PerSampleDP:
    """Record-level DP-SGD (Abadi et al. 2016) through Opacus: per-sample clip c, noise z·c, Poisson batches."""

    noise_multiplier: float
    clip: float
    grad_sample_mode: str = "hooks"
    cuda_graphs: bool = False  # padded steps replayed as CUDA graphs (fedapp.clients.graphed_dpsgd); eager on a CPU
    noise_only: bool = False  # every batch empty: each step the mechanism's noise alone (q and steps unchanged)


@dataclass(frozen=True)
class SAM:
    """Sharpness-aware minimization (DP2-FedSAM Eq. 11–12), ASAM when ``adaptive``."""

    rho: float
    adaptive: bool = False
    eta: float = 0.01


@dataclass(frozen=True)
class LocalTraining:
    """What one client's local training runs; every family's loop is this one with different hooks.

    * batches: ``steps`` minibatches of size b walking seeded shuffles of the data (a new shuffle per
      pass, last partial batch kept, so ⌈N/b⌉ steps are one epoch); with ``dp`` Opacus' Poisson batches
      (q = 1/⌈N/b⌉, ⌈N/b⌉ per epoch) instead;
    * parameters: ``trainable`` state-dict names only (partial sharing, DP2-FedSAM's φ/h), or all;
    * gradient: plain, or SAM's gradient at the perturbed point (``sam``);
    * privacy: per-sample clipping + noise (``dp``); whole-update clipping and compression are applied
      to the resulting update by the client (``strategies.privacy.mechanisms``, ``strategies.compression``).
    """

    batch_size: int
    steps: int
    lr: float
    momentum: float = 0.0
    seed: int = 0
    trainable: tuple[str, ...] | None = None
    sam: SAM | None = None
    dp: PerSampleDP | None = None
    #: the batch loss (None: cross-entropy); with ``dp`` it must be the mean of per-sample losses (Opacus' "mean")
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class PlainSGD:
    """``torch.optim.SGD``'s update (momentum μ, dampening 0, no weight decay, no Nesterov), bit for bit,
    without ``torch.optim``: constructing any torch optimizer imports ``torch._dynamo`` (1.3 s and ~75 MB in
    every Ray actor on the 2-core reference machine) only to mark the optimizer as not compilable.

    Per step: b ← g on the first step, else b ← μ·b + g; θ ← θ − η·b (θ ← θ − η·g when μ = 0).
    It carries the ``param_groups`` / ``defaults`` / ``state`` that Opacus' ``DPOptimizer`` reads from the
    optimizer it wraps, so DP-SGD steps through it too (η and μ are read from the one group each step); there,
    Opacus already imports part of what ``torch._dynamo`` needs, and the saving is ~0.4 s and ~25 MB.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: float, momentum: float = 0.0) -> None:
        self.params = list(params)
        self.defaults: dict[str, Any] = {"lr": float(lr), "momentum": float(momentum)}
        self.param_groups: list[dict[str, Any]] = [{"params": self.params, **self.defaults}]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_momentum(self) -> list[torch.Tensor]:
        """The momentum buffers, allocated as zeros now (none without momentum): b ← μ·0 + g = g is the same first
        step, and an update captured in a CUDA graph accumulates into these fixed tensors."""
        if float(self.param_groups[0]["momentum"]) == 0.0:
            return []
        buffers = [torch.zeros_like(p) for p in self.params]
        self._buffers = list(buffers)
        return buffers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, momentum = float(group["lr"]), float(group["momentum"])
        for i, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                continue
            if momentum != 0.0:
                buf = self._buffers[i]
                if buf is None:
                    buf = self._buffers[i] = torch.clone(grad).detach()
                else:
                    buf.mul_(momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-lr)


@contextlib.contextmanager
def cpu_memory_format(model: nn.Module, device: torch.device) -> Iterator[None]:
    """While open, ``model``'s weights on a CPU are in its class's ``CPU_MEMORY_FORMAT`` (channels-last for the
    plain CNNs of :mod:`fedapp.models.zoo`, whose convolutions run faster so), contiguous again after.
    Not for Opacus' per-sample gradients (its convolution grad-samplers assume the default layout); for ``bk``'s."""
    fmt = getattr(type(model), "CPU_MEMORY_FORMAT", None)  # the class's: a wrapper's __getattr__ must not answer
    if fmt is None or device.type != "cpu":
        yield
        return
    relayout(model, fmt)
    try:
        yield
    finally:
        relayout(model, torch.contiguous_format)


def relayout(model: nn.Module, fmt: torch.memory_format) -> None:
    """What ``model.to(memory_format=fmt)`` does: the same Parameter objects, each 4-d one's data copied into the
    strides of ``fmt``. A copy, not ``contiguous(memory_format=fmt)``: a weight with one input channel (the first conv
    of an MNIST CNN) counts as contiguous in both layouts, so ``contiguous`` would keep its default strides, and
    oneDNN, which picks a convolution's layout from its weight's strides, would run that layer and the pooling after
    it in the default layout (1.4x the time of a local epoch of the MNIST CNN on one thread)."""
    for p in model.parameters():
        if p.dim() == 4:
            p.data = torch.empty_like(p.data, memory_format=fmt).copy_(p.data)


def default_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a tensor of ``shape`` in the default (contiguous) layout, as
    ``torch.empty(shape).stride()`` gives them, without allocating one."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def epochs_to_steps(num_examples: int, batch_size: int, epochs: int) -> int:
    return int(epochs) * steps_per_epoch(num_examples, batch_size)


def _shuffled_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, steps: int, seed: int):
    """``steps`` batches of ``batch_size`` records, a fresh permutation of the data per epoch (seeded). Each epoch's
    records are gathered once, in permuted order, and the batches are slices of that copy: the same batches as
    gathering each batch's rows, but contiguous, which made one epoch of the CNN on one CPU thread 25-30 % faster
    (docs/benchmarks.md, "Memory and start-up settings, measured")."""
    rng = np.random.default_rng(seed)
    xs, ys, pos = x[:0], y[:0], 0
    for _ in range(steps):
        if pos >= len(ys):
            order = torch.from_numpy(rng.permutation(len(y)))
            xs, ys, pos = x[order], y[order], 0
        yield xs[pos:pos + batch_size], ys[pos:pos + batch_size]
        pos += batch_size


def _poisson_batches(x: torch.Tensor, y: torch.Tensor, sample_rate: float, per_epoch: int, epochs: int,
                     generator: torch.Generator | None = None):
    """The batches of Opacus' ``DPDataLoader`` (``UniformWithReplacementSampler``: every record joins every step
    independently with probability q), drawn where the data lives.

    The draws are Opacus' own, in its order: per epoch the base seed a ``DataLoader`` iterator takes, per step
    ``rand(N) < q``, from ``generator`` (default: the default generator of the data's device). On the CPU the
    batches are therefore the loader's, bit for bit, for a generator in the default one's state
    (tests/unit/fedapp/clients/test_poisson_batches.py); on a GPU they have the same law and no batch is collated
    record by record on the host and copied over.
    """
    n = len(y)
    for _ in range(epochs):
        torch.empty((), dtype=torch.int64).random_(generator=generator)  # the DataLoader iterator's base-seed draw
        for _ in range(per_epoch):
            rows = (torch.rand(n, device=x.device, generator=generator) < sample_rate).nonzero().reshape(-1)
            yield x[rows], y[rows]


#: held while a client seeds the process's default torch generator and draws from it (a model's seeded build, the seed
#: before DP-SGD): ClientApps on threads of one process (fedapp.compat.thread_backend) share that generator, and a
#: seed set by one client in the middle of another's build would change the other's weights
DEFAULT_GENERATOR = threading.RLock()


def _seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator of ``device`` in the state ``torch.manual_seed(seed)`` leaves its default one in: the same draws,
    without the process-wide stream that another client training in another thread of the process would also draw
    from and reseed (:mod:`fedapp.compat.thread_backend`)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _private(model: nn.Module, optimizer: PlainSGD, data: ArrayDataset, spec: LocalTraining,
             sample_rate: float, generator: torch.Generator | None = None):
    """(wrapped module, DP optimizer, None) as Opacus' ``PrivacyEngine.make_private(poisson_sampling=True)`` builds
    them (same validation, module class and optimizer arguments, the optimizer Opacus' ``DPOptimizer`` with the clip
    step of :func:`~fedapp.clients.finite_clipping.finite_clip_dp_optimizer`; no engine accountant: the client's
    ledger composes), for batches this module draws itself at ``sample_rate``: ⌈N/b⌉ steps an epoch at q = 1/⌈N/b⌉, what the
    accountant composes. (Opacus' loader has int(1/q) batches, one fewer where ⌈N/b⌉ ∈ {93, 99, 105, …}, and
    ``make_private`` then reports q = 1/92 for a loader that samples at 1/93.) With ``grad-sample-mode = "bk"``:
    (the model itself, Opacus' optimizer taking the clipped sums as given, the
    :class:`~fedapp.clients.book_keeping.BookKeeping` that computes them)."""
    from opacus.grad_sample import prepare_module
    from opacus.optimizers import DPOptimizer, get_optimizer_class
    from opacus.validators.module_validator import ModuleValidator

    from fedapp.clients.finite_clipping import finite_clip_dp_optimizer

    dp = spec.dp
    if dp is None:
        raise ValueError("Opacus training needs a DP spec (LocalTraining.dp)")
    book_keeping = dp.grad_sample_mode == "bk"
    if book_keeping and spec.sam is not None:
        raise ValueError("grad-sample-mode 'bk' computes one clipped gradient a step; SAM needs two: use 'hooks'")
    if not book_keeping and get_optimizer_class(clipping="flat", distributed=False,
                                                grad_sample_mode=dp.grad_sample_mode) is not DPOptimizer:
        raise ValueError(f"grad-sample-mode {dp.grad_sample_mode!r} clips outside DPOptimizer; this client's clipping "
                         "(fedapp.clients.finite_clipping) covers 'hooks', 'ew' and 'functorch'")
    with DEFAULT_GENERATOR:
        torch.manual_seed(spec.seed)
    ModuleValidator.validate(model, strict=True)
    # exact default strides: a one-input-channel conv weight with channels-last strides passes is_contiguous() and
    # still makes its conv's output channels-last, which Opacus reads as wrong (0.31 off; tests/.../test_memory_format)
    relaid = [n for n, p in model.named_parameters() if p.stride() != default_strides(p.shape)]
    if relaid:
        raise ValueError(f"per-sample gradients need weights in the default (contiguous) layout; not so: {relaid}")
    kwargs = dict(optimizer=optimizer, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.clip,
                  expected_batch_size=int(len(data) * sample_rate), loss_reduction="mean", generator=generator,
                  secure_mode=False)
    if book_keeping:  # the model itself with forward hooks; its clipped sums come from BookKeeping.clipped_sum
        from fedapp.clients.book_keeping import BookKeeping, book_keeping_dp_optimizer

        return model, book_keeping_dp_optimizer()(**kwargs), BookKeeping(model)
    module = prepare_module(model, grad_sample_mode=dp.grad_sample_mode, batch_first=True, loss_reduction="mean",
                            wrap_model=True)
    module.forbid_grad_accumulation()
    # Opacus' flat DPOptimizer, a clip step no non-finite gradient bypasses
    return module, finite_clip_dp_optimizer()(**kwargs), None


def local_train(model: nn.Module, data: ArrayDataset, spec: LocalTraining,
                device: torch.device | None = None) -> TrainResult:
    """Run ``spec`` in place on ``model``; the one local-training loop of every client.

    With ``spec.dp`` the result's ``extra["sample_rate"]`` is the q the accountant must compose and
    ``steps`` the Poisson steps taken (a multiple of ⌈N/b⌉: ``spec.steps`` is rounded up to whole epochs).
    """
    from fedapp.compat.heap import reuse_freed_memory
    from strategies.dp2_fedsam import sam_gradient

    reuse_freed_memory()  # once per process: a step's freed tensors stay mapped for the next step
    device = device or torch.device("cpu")
    model.to(device).train()
    named = dict(model.named_parameters())
    names = list(named) if spec.trainable is None else list(spec.trainable)
    missing = [n for n in names if n not in named]
    if missing:
        raise ValueError(f"no trainable parameters named {missing}")
    params = [named[n] for n in names]
    if spec.steps <= 0 or not params or len(data) == 0:
        return TrainResult(0, float("nan"), 0.0)
    saved = {n: p.requires_grad for n, p in named.items()}
    for n, p in named.items():
        p.requires_grad_(n in set(names))
    opt = PlainSGD(params, lr=spec.lr, momentum=spec.momentum)  # also what Opacus wraps for DP-SGD
    loss_fn = spec.loss if spec.loss is not None else nn.CrossEntropyLoss()
    start, steps, total, extra = time.perf_counter(), 0, 0.0, {}
    module, optimizer, book_keeping = model, opt, None
    layout = contextlib.ExitStack()
    try:
        if spec.dp is not None:
            per_epoch = steps_per_epoch(len(data), spec.batch_size)
            sample_rate = dpsgd_sample_rate(len(data), spec.batch_size)
            # on a CPU the noise and the batches come from this training's own stream, seeded as the default one was
            generator = _seeded_generator(spec.seed, device) if device.type == "cpu" else None
            module, optimizer, book_keeping = _private(model, opt, data, spec, sample_rate, generator)
            if book_keeping is not None:  # its own convolution rule reads any layout: the CNNs' faster one on a CPU
                layout.callback(book_keeping.close)
                layout.enter_context(cpu_memory_format(model, device))
            extra["sample_rate"] = sample_rate
            x_dev, y_dev = torch.from_numpy(data.x).to(device), torch.from_numpy(data.y).to(device)
            epochs = -(-spec.steps // per_epoch)
            if spec.dp.noise_only:  # no record enters: every per-sample gradient of every step is clipped to 0
                batches = iter([(x_dev[:0], y_dev[:0])] * (epochs * per_epoch))
            elif spec.dp.cuda_graphs:
                return _graphed(model, module, optimizer, opt, params, spec, x_dev, y_dev, sample_rate, per_epoch,
                                epochs, start, extra)
            else:
                batches = _poisson_batches(x_dev, y_dev, sample_rate, per_epoch, epochs, generator)
        else:  # a plain CNN runs channels-last on a CPU (per-sample gradients keep the default layout)
            layout.enter_context(cpu_memory_format(model, device))
            batches = _shuffled_batches(torch.from_numpy(data.x), torch.from_numpy(data.y), spec.batch_size, spec.steps,
                                        spec.seed)
        for xb, yb in batches:
            xb, yb = xb.to(device), yb.to(device)

            def closure(xb: torch.Tensor = xb, yb: torch.Tensor = yb) -> torch.Tensor:
                optimizer.zero_grad(set_to_none=spec.sam is None)
                if spec.dp is not None and len(yb) == 0:  # empty Poisson batch: noise only; ew/functorch cannot
                    if book_keeping is not None:  # run a batch of 0, so no forward
                        book_keeping.zero_sum()  # every clipped sum is 0
                    else:  # Opacus clips 0 per-sample gradients
                        for p in params:
                            setattr(p, "grad_sample", torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device))  # noqa: B010
                    return torch.zeros((), device=device)
                out = module(xb)
                loss = loss_fn(out, yb)
                reg = _regularization(model) if spec.dp is None else None
                if reg is not None:
                    loss = loss + reg
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="Full backward hook")
                    if book_keeping is not None:
                        assert spec.dp is not None
                        book_keeping.clipped_sum(loss, spec.dp.clip)
                    else:
                        loss.backward()
                return loss.detach()

            if spec.sam is None:
                loss = closure()
            else:
                loss = sam_gradient(params, closure, spec.sam.rho, spec.sam.adaptive, spec.sam.eta)
            optimizer.step()
            if spec.dp is not None:
                _data_independent_step(model, params, spec.lr)
            steps += 1
            total += float(loss)
    finally:
        layout.close()
        close = getattr(module, "_close", None) if module is not model else None
        if callable(close):
            close()  # remove Opacus hooks so the plain module can be reused/serialized
        for n, p in named.items():
            p.requires_grad_(saved[n])
    return TrainResult(steps, total / max(steps, 1), time.perf_counter() - start, extra)


def _graphed(model: nn.Module, module: nn.Module, optimizer, opt: PlainSGD, params: Sequence[torch.Tensor],
             spec: LocalTraining, x: torch.Tensor, y: torch.Tensor, sample_rate: float, per_epoch: int, epochs: int,
             start: float, extra: dict) -> TrainResult:
    """``local_train``'s DP-SGD loop with padded Poisson batches, each step one CUDA graph replay on a GPU."""
    from fedapp.clients.graphed_dpsgd import run_padded

    assert spec.dp is not None
    if spec.sam is not None or spec.dp.grad_sample_mode != "hooks":
        raise ValueError(f"CUDA-graphed DP-SGD captures plain Opacus hooks steps; got grad-sample-mode "
                         f"{spec.dp.grad_sample_mode!r}, sam {spec.sam!r}")
    steps, mean_loss = run_padded(module, optimizer, params, opt.zero_momentum(), x, y, sample_rate, per_epoch, epochs,
                                  after_step=lambda: _data_independent_step(model, params, spec.lr))
    return TrainResult(steps, mean_loss, time.perf_counter() - start, extra)


def _data_independent_step(model: nn.Module, params: Sequence[torch.Tensor], lr: float) -> None:
    """A plain step on the model's data-independent regularizer (its gradient costs no privacy)."""
    reg = _regularization(model)
    if reg is None or not reg.requires_grad:  # e.g. λ = 0: a constant, nothing to step on
        return
    grads = torch.autograd.grad(reg, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.add_(g, alpha=-lr)


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
    with cpu_memory_format(model, device):
        for start in range(0, len(data), batch_size):
            xb = torch.tensor(data.x[start:start + batch_size], device=device)  # a copy: pools are read-only
            yb = torch.tensor(data.y[start:start + batch_size], device=device)
            out = model(xb)
            total_loss += float(loss_fn(out, yb))
            correct += int((out.argmax(1) == yb).sum())
    return total_loss / len(data), correct / len(data)
