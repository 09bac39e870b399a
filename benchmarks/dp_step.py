"""DP-SGD step time per per-sample-gradient mode ÷ the fastest non-private step, for the catalog's models on a CPU.

    python -m benchmarks.foundation step [--quick] [--models cnn-mnist,cnn-fmnist] [--batch 64]

Per model, a batch (64 unless ``--batch``) of synthetic inputs of its dataset's shape: a plain SGD step in the
default layout and, for a model with a ``CPU_MEMORY_FORMAT``, in that layout (as the project's non-private clients
run it); a DP-SGD step (clip 1, noise 1) in Opacus' ``hooks``, ``ew``, ``functorch`` and ``ghost`` modes
(``make_private``) and in ``bk`` (:mod:`fedapp.clients.book_keeping`, in the layout ``local_train`` gives it); and
Opacus' Gaussian noise alone (``_generate_noise`` for every parameter, as each Opacus mode's optimizer draws it), whose
time added to the plain step bounds those modes' ratio from below, and ``bk``'s noise added to the clipped sums
(:func:`fedapp.clients.noise.add_noise_`), its own floor. The variants are timed interleaved,
``rounds`` rounds of ``steps`` steps each after a warm-up, so drift on a shared machine hits them alike; each cell is
the median over rounds of the per-round median step. Each DP mode's clipped gradient at zero noise is checked against
``hooks``'.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from fedapp.models.catalog import DEFAULT_MODEL, INPUT_SHAPES, NUM_CLASSES

BATCH = 64
OPACUS_MODES = ("hooks", "ew", "functorch", "ghost")
#: (rounds, steps) for a model whose steps take seconds on 2 cores
HEAVY = {"resnet18-gn": (3, 2)}
#: the catalog's models; ResNet-18 last, by far the slowest
MODELS = ("cnn-mnist", "cnn-fmnist", "cnn-cifar", "cnn-digits", "mlp-sigmoid", "mlp-digits", "logreg", "resnet18-gn")


def _shape(model: str) -> tuple[tuple[int, ...], int]:
    """The input shape and classes of the dataset ``model`` is the default for (the MNIST ones for the rest)."""
    dataset = next((d for d, m in DEFAULT_MODEL.items() if m == model),
                   "digits" if model.endswith("-digits") else "mnist")
    return INPUT_SHAPES[dataset], NUM_CLASSES[dataset]


def _private(mode: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, noise: float,
             layout: bool = True) -> Callable[[], None]:
    """One DP-SGD step (clip 1) of ``model`` on (x, y) in ``mode``, as a function; ``bk`` in the model's
    ``CPU_MEMORY_FORMAT`` (as ``local_train`` runs it) unless not ``layout``."""
    from torch.utils.data import DataLoader, TensorDataset

    crit = nn.CrossEntropyLoss()
    if mode == "bk":
        from fedapp.clients.book_keeping import BookKeeping, book_keeping_dp_optimizer
        from fedapp.clients.training import relayout

        fmt = getattr(type(model), "CPU_MEMORY_FORMAT", None)
        if fmt is not None and layout:
            relayout(model, fmt)
        book_keeping = BookKeeping(model)
        opt = book_keeping_dp_optimizer()(torch.optim.SGD(model.parameters(), lr=0.05), noise_multiplier=noise,
                                          max_grad_norm=1.0, expected_batch_size=len(y))

        def bk_step() -> None:
            opt.zero_grad(set_to_none=True)
            book_keeping.clipped_sum(crit(model(x), y), 1.0)
            opt.step()
        return bk_step
    from opacus import PrivacyEngine

    loader = DataLoader(TensorDataset(x, y), batch_size=len(y))
    out = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), data_loader=loader, criterion=crit,
        noise_multiplier=noise, max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode=mode)
    module, optimizer, criterion = (out[0], out[1], out[2]) if mode == "ghost" else (out[0], out[1], crit)

    def opacus_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(module(x), y).backward()
        optimizer.step()
    return opacus_step


def _plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, fmt: torch.memory_format | None) -> Callable[[], None]:
    from fedapp.clients.training import relayout

    if fmt is not None:
        relayout(model, fmt)
    opt, crit = torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        crit(model(x), y).backward()
        opt.step()
    return step


def _noise(model: nn.Module) -> Callable[[], None]:
    """Opacus' noise N(0, 1) for each of ``model``'s parameters, drawn as ``DPOptimizer.add_noise`` draws it."""
    from opacus.optimizers.optimizer import _generate_noise

    params = [p.detach() for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)

    def draw() -> None:
        for p in params:
            _generate_noise(std=1.0, reference=p, generator=generator)
    return draw


def _bk_noise(model: nn.Module) -> Callable[[], None]:
    """``bk``'s noise N(0, 1) added to a clipped sum for each of ``model``'s parameters
    (:func:`fedapp.clients.noise.add_noise_`: parallel chunks for a large model on more than one thread, into a buffer
    kept from step to step as the optimizer keeps it)."""
    from fedapp.clients.noise import add_noise_

    sums = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)
    scratch: list[torch.Tensor | None] = [None]

    def draw() -> None:
        scratch[0] = add_noise_(sums, 1.0, generator, scratch[0])
    return draw


def _clipped_gradient(new_model: Callable[[], nn.Module], mode: str, x: torch.Tensor, y: torch.Tensor
                      ) -> torch.Tensor:
    """The parameter change of one zero-noise DP-SGD step (lr 0.05): the averaged clipped gradient, times −lr."""
    model = new_model()
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    _private(mode, model, x, y, noise=0.0)()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per variant, the median step of each round: two warm-up calls each (kernels, Opacus' hooks), then ``rounds``
    rounds in which every variant takes ``steps`` timed steps in turn, so drift hits them alike."""
    times: dict[str, list[float]] = {label: [] for label in variants}
    for step in variants.values():
        for _ in range(2):
            step()
    for _ in range(rounds):
        for label, step in variants.items():
            per_step = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                per_step.append(time.perf_counter() - t0)
            times[label].append(statistics.median(per_step))
    return times


def bench_model(name: str, rounds: int, steps: int, batch: int = BATCH) -> list[str]:
    from fedapp.models.zoo import build_model

    shape, classes = _shape(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((batch, *shape), generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)

    def new_model() -> nn.Module:
        torch.manual_seed(0)
        return build_model(name, shape, classes)

    fmt = getattr(type(new_model()), "CPU_MEMORY_FORMAT", None)
    variants: dict[str, Callable[[], None]] = {"non-private, default layout": _plain(new_model(), x, y, None)}
    if fmt is not None:
        variants["non-private, channels-last"] = _plain(new_model(), x, y, fmt)
    checks: dict[str, str] = {}
    reference = _clipped_gradient(new_model, "hooks", x, y)
    runs = [(mode, True) for mode in (*OPACUS_MODES, "bk")] + ([("bk", False)] if fmt is not None else [])
    for mode, layout in runs:
        label = f"DP-SGD `{mode}`" + ("" if fmt is None or mode != "bk" else
                                      ", channels-last" if layout else ", default layout")
        try:
            diff = float((_clipped_gradient(new_model, mode, x, y) - reference).abs().max())
            scale = float(reference.abs().max())
            checks[label] = (f"{'same as' if diff <= 1e-3 * scale else 'DIFFERS from'} `hooks` "
                             f"(max abs diff {diff:.1e} of {scale:.1e})")
            variants[label] = _private(mode, new_model(), x, y, noise=1.0, layout=layout)
        except Exception as exc:  # noqa: BLE001 — a mode this model or torch does not support: reported
            checks[label] = f"does not run: {type(exc).__name__}: {str(exc)[:70]}"
    noise_label, bk_noise_label = "Opacus' noise alone (not a step)", "`bk`'s noise added to the sums (not a step)"
    variants[noise_label] = _noise(new_model())
    variants[bk_noise_label] = _bk_noise(new_model())
    times = interleaved(variants, rounds, steps)
    median = {label: statistics.median(ts) for label, ts in times.items()}
    fastest_plain = min(t for label, t in median.items() if label.startswith("non-private"))
    checks[noise_label] = (f"every DP mode's floor: (fastest non-private + noise) ÷ fastest non-private = "
                           f"{(fastest_plain + median[noise_label]) / fastest_plain:.2f}×")
    checks[bk_noise_label] = (f"`bk`'s floor: (fastest non-private + its noise) ÷ fastest non-private = "
                              f"{(fastest_plain + median[bk_noise_label]) / fastest_plain:.2f}×")
    rows = []
    for label in [*variants, *(c for c in checks if c not in variants)]:
        if label in median:
            rows.append(f"| {name} | {label} | {median[label] * 1e3:.2f} ms | {median[label] / fastest_plain:.2f}× | "
                        f"{checks.get(label, 'reference' if label.startswith('non-private') else '')} |")
        else:
            rows.append(f"| {name} | {label} | – | – | {checks[label]} |")
    return rows


def bench_step(quick: bool, models: tuple[str, ...] | None = None, batch: int = BATCH) -> list[str]:
    from fedapp.compat.heap import reuse_freed_memory

    warnings.filterwarnings("ignore")
    reuse_freed_memory()  # the allocator as a client's local_train sets it, for every variant alike
    models = models or (("cnn-mnist",) if quick else MODELS)
    rounds, steps = (3, 5) if quick else (7, 10)
    header = [f"| model | step (batch {batch}, CPU, {torch.get_num_threads()} threads) | median | "
              "÷ fastest non-private | zero-noise check |", "|---|---|---|---|---|"]
    rows = list(header)
    for name in models:
        rows += bench_model(name, *HEAVY.get(name, (rounds, steps)), batch=batch)
        print("\n".join(rows[-1:]), file=sys.stderr, flush=True)  # progress: a long run shows where it is
    return rows
