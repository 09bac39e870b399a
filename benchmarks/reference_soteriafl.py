"""SoteriaFL: this project's math against the authors' reference numpy code, on identical inputs.

Reference: github.com/haoyuzhao123/soteriafl (``optimizers.py``: ``SoteriaFL``, ``CDP_SGD``; notebook
``SoteriaFL_a9a.ipynb``) on top of its dependency github.com/liboyue/Network-Distributed-Algorithm (``nda``:
``Optimizer``, ``compressor.random``, ``LogisticRegression``). Neither is copied here: both are loaded from the
paths given on the command line (default ``/tmp/ref/soteriafl`` and ``/tmp/ref/nda``); the script exits with a
message when they are absent. Only three pieces of ``nda`` are replaced, none of them math: its logger (needs
``colorlog``), ``nda.optimizers.utils`` (imports ``cvxpy``; only the constant ``eps`` and ``NAG`` are used, NAG only
for ``kappa``), and the LibSVM downloader (the real ``load_raw`` reads ``a9a``/``a9a.t`` from ``--data-dir``).

Three parts, all on the reference problem ``LogisticRegression(n_agent=10, dataset='a9a', sort=True, alpha=0.2)``
(label-sorted split, nonconvex regularizer of Sec. 6.1) and its x₀ = randn(d)/5 (``np.random.seed(0)``):

1. *Building blocks*: f(x), ∇f(x), the minibatch gradient, the random-k compressor and γ of both codes.
2. *Identical inputs*: the same minibatch indices, random-k masks (the project's seed-derived masks, fed to the
   reference's ``compressor.random`` through its swappable array module ``xp``) and noise draws go to the
   reference optimizer and to this project's ``client_step`` + ``ServerState`` (Alg. 2); max |x_ref − x_ours|
   per round, with clipping inactive (G = 1e6) and at the paper's G = 0.5 (the reference clips the minibatch
   *mean*, Sec. 6 / ``optimizers.py``; this project clips each per-sample gradient, which DP needs).
3. *Each with its own randomness*: final training objective f(x_T) over seeds (mean ± 95 % t-interval) for
   SoteriaFL-SGD and CDP-SGD (Alg. 1, direct compression) in both codes, at the notebook's setting (ε = 5 cell:
   T = 100, Theorem-2 σ with c = 12 / c = 8, η = 0.3 / 0.1) and at this project's quick-sweep setting (T = 40,
   η = 0.1, accountant σ_p for both), plus paired differences SoteriaFL − CDP over the same seeds.

    .venv/bin/python benchmarks/reference_soteriafl.py                       # ~20 min on 2 shared cores
    .venv/bin/python benchmarks/reference_soteriafl.py --seeds 3 --parts 1,2 # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedapp.experiments.report import interval  # noqa: E402
from fedapp.models.zoo import LogisticRegression as TorchLogReg  # noqa: E402
from strategies.compression import rand_k_compress, rand_k_decompress, rand_k_indices, rand_k_omega  # noqa: E402
from strategies.privacy.accountants import epsilon_of  # noqa: E402
from strategies.soteriafl import (  # noqa: E402
    METHODS,
    ClientState,
    GradientOracle,
    ServerState,
    calibrate_sigma,
    client_step,
    default_batch_size,
    default_k,
    fit_seed,
    mask_seed,
    noise_history,
    shift_stepsize,
)

N_AGENT, G_PAPER, DELTA, EPS, LAMBDA = 10, 0.5, 1e-3, 5.0, 0.2


# ----------------------------------------------------------------------------- loading the reference
def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Reference:
    """The reference modules: ``opt`` = soteriafl/optimizers.py, ``comp`` = nda compressor, ``lr`` = nda problem."""

    opt: types.ModuleType
    comp: types.ModuleType
    logreg: types.ModuleType


def load_reference(soteriafl_dir: Path, nda_dir: Path, data_dir: Path) -> Reference:
    """Import the reference ``optimizers.py`` and the parts of ``nda`` it needs, from the given checkouts."""
    pkg = nda_dir / "nda"
    need = [soteriafl_dir / "optimizers.py", pkg / "optimizers" / "optimizer.py", pkg / "optimizers" / "compressor.py",
            pkg / "problems" / "problem.py", pkg / "problems" / "logistic_regression.py",
            pkg / "datasets" / "dataset.py", pkg / "datasets" / "libsvm.py"]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise FileNotFoundError(", ".join(missing))
    import logging

    def package(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__path__ = []  # a package, so that "from nda.x import y" resolves through sys.modules
        sys.modules[name] = mod
        return mod

    nda = package("nda")
    log = types.ModuleType("nda.log")  # stand-in: the real one needs colorlog
    for level in ("debug", "info", "warning", "warn", "error", "fatal"):
        setattr(log, level, getattr(logging.getLogger("nda"), "warning" if level == "warn" else
                                    "critical" if level == "fatal" else level))
    sys.modules["nda.log"] = nda.log = log  # type: ignore[attr-defined]
    optimizers = package("nda.optimizers")
    utils = types.ModuleType("nda.optimizers.utils")  # stand-in: the real one imports cvxpy
    utils.eps = 1e-6  # type: ignore[attr-defined]  # the value in nda/optimizers/utils.py

    def nag(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("NAG (only for kappa != None) is not loaded")

    utils.NAG = nag  # type: ignore[attr-defined]
    sys.modules["nda.optimizers.utils"] = optimizers.utils = utils  # type: ignore[attr-defined]
    optimizers.Optimizer = _load_file("nda.optimizers.optimizer", pkg / "optimizers" / "optimizer.py").Optimizer  # type: ignore[attr-defined]
    comp = _load_file("nda.optimizers.compressor", pkg / "optimizers" / "compressor.py")
    optimizers.compressor = comp  # type: ignore[attr-defined]
    datasets = package("nda.datasets")
    datasets.Dataset = _load_file("nda.datasets.dataset", pkg / "datasets" / "dataset.py").Dataset  # type: ignore[attr-defined]
    real_libsvm = _load_file("nda.datasets.libsvm", pkg / "datasets" / "libsvm.py").LibSVM

    class LocalLibSVM(real_libsvm):  # type: ignore[misc, valid-type]
        """The real ``load_raw`` (sklearn ``load_svmlight_file``, labels −1 → 0) on local files; no download/cache."""

        def load(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            for base in (data_dir / self.name, data_dir):
                if (base / self.name).is_file():
                    self.data_dir = str(base)
                    break
            self.load_raw()
            return self.X_train, self.Y_train, self.X_test, self.Y_test

    datasets.LibSVM = LocalLibSVM  # type: ignore[attr-defined]
    nda.datasets = datasets  # type: ignore[attr-defined]
    problems = package("nda.problems")
    problems.Problem = _load_file("nda.problems.problem", pkg / "problems" / "problem.py").Problem  # type: ignore[attr-defined]
    logreg = _load_file("nda.problems.logistic_regression", pkg / "problems" / "logistic_regression.py")
    opt = _load_file("soteriafl_reference_optimizers", soteriafl_dir / "optimizers.py")
    return Reference(opt, comp, logreg)


# ----------------------------------------------------------------------------- the problem, both sides
@dataclass
class Setup:
    """Reference problem + x₀ and this project's oracles on the *same* arrays.

    ``data = "reference"``: the notebook's cell 'eps = 5' as is (nda rescales the training features, see
    :func:`feature_scale`) and x₀ = randn(d)/5. ``data = "raw"``: the same split with the unscaled a9a features this
    project's loader gives (``fedapp.data.datasets.read_libsvm``) and x₀ = the torch default init of its logreg model
    (seed 0): the inputs of the project's quick sweep, for both codes.
    """

    ref: Reference
    problem: Any
    x0: np.ndarray
    d: int
    m: int
    k: int
    omega: float
    gamma: float
    oracles: list[GradientOracle]
    data: str


def feature_scale(problem: Any) -> tuple[float, float]:
    """The factors nda applied to the training and test features (read off the appended ones column).

    ``LogisticRegression._init`` divides ``X_train`` and then ``X`` — a reshaped *view* of the same array — by
    ``norm = ‖X_train‖₂ / (2√N)``, and ``__init__`` divides ``X_train`` once more, so the training features end up
    divided by norm³ and the test features by norm.
    """
    return float(np.asarray(problem.X_train)[0, -1]), float(np.asarray(problem.X_test)[0, -1])


def make_setup(ref: Reference, data: str = "reference") -> Setup:
    """``LogisticRegression(n_agent=10, dataset='a9a', sort=True, normalize_data=False, graph_params=0.8,
    alpha=0.2)`` and x₀ = randn(d)/5 after ``np.random.seed(0)``, as in the notebook."""
    np.random.seed(0)
    with contextlib.redirect_stderr(io.StringIO()):
        problem = ref.logreg.LogisticRegression(n_agent=N_AGENT, dataset="a9a", sort=True, normalize_data=False,
                                                graph_params=0.8, alpha=LAMBDA)
    x0 = np.random.randn(problem.dim) / 5
    if data == "raw":
        train_scale, test_scale = feature_scale(problem)
        problem.X_train /= train_scale  # in place: problem.X[i] are views of it
        problem.X_test /= test_scale
        torch.manual_seed(0)
        init = TorchLogReg(problem.dim - 1, 2)
        x0 = np.concatenate([init.fc.weight.detach().numpy().ravel(), init.fc.bias.detach().numpy()]).astype(np.float64)
    elif data != "reference":
        raise ValueError(data)
    d, m = int(problem.dim), int(problem.m)
    k = int(d / 20)  # the notebook's compression_param; = strategies.soteriafl.default_k(d)
    omega = d / k - 1
    return Setup(ref, problem, x0, d, m, k, omega, shift_stepsize(omega), client_oracles(problem), data)


class ColumnLogReg(TorchLogReg):
    """This project's logreg model (two logits [0, aᵀx], λ Σ x²/(1+x²)) with the reference's parametrization:
    the intercept is the last *data column* (the reference appends a ones column and then rescales it with the
    features), so the torch layer has no separate bias and x ∈ R^d is the same vector in both codes."""

    def __init__(self, in_features: int, nonconvex_lambda: float) -> None:
        super().__init__(in_features, 2, nonconvex_lambda=nonconvex_lambda)
        self.fc = torch.nn.Linear(in_features, 1, bias=False)


def oracle(x: np.ndarray, y: np.ndarray, chunk: int = 4096) -> GradientOracle:
    return GradientOracle(ColumnLogReg(x.shape[1], LAMBDA), x, np.asarray(y).astype(np.int64), chunk=chunk)


def client_oracles(problem: Any) -> list[GradientOracle]:
    """This project's per-sample-gradient oracles on the reference's client arrays ``problem.X[i]``."""
    return [oracle(np.asarray(problem.X[i]), problem.Y[i]) for i in range(problem.n_agent)]


def ref_objective(s: Setup, x: np.ndarray) -> float:
    """f(x) = h(x) + g(x) on the reference's training data (the paper's 'Loss' axis)."""
    return float(s.problem.f(np.asarray(x, dtype=np.float64)))


def test_loss(s: Setup, x: np.ndarray) -> float:
    """Mean logistic loss on a9a.t without the regularizer (the sweep's ``final_loss``); raw data only, because nda
    scales the test features differently from the training features (:func:`feature_scale`)."""
    return float(s.problem.h(np.asarray(x, dtype=np.float64), split="test"))


# ----------------------------------------------------------------------------- part 1: building blocks
def building_blocks(s: Setup, seed: int = 0) -> dict[str, float]:
    """Max abs differences of the pieces both codes share, at x₀ and a random point."""
    rng = np.random.default_rng(seed)
    out: dict[str, float] = {}
    pooled = oracle(np.asarray(s.problem.X_train), s.problem.Y_train)
    diffs_f, diffs_g, diffs_mb = [], [], []
    for x in (s.x0, rng.normal(size=s.d)):
        f_ours, g_ours = pooled.loss_and_grad(x)
        diffs_f.append(abs(f_ours - ref_objective(s, x)))
        diffs_g.append(float(np.abs(g_ours - s.problem.grad(x)).max()))
        idx = rng.integers(0, s.m, size=51)
        for i in (0, 7):
            ref_mb = s.problem.grad(x, i=i, j=idx)  # (1/b) Σ_j ∇h_ij + ∇g, what the reference's SGD step computes
            ours = s.oracles[i].per_sample(x, idx).mean(0)
            diffs_mb.append(float(np.abs(ref_mb - ours).max()))
    out["objective f"] = max(diffs_f)
    out["full gradient"] = max(diffs_g)
    out["minibatch gradient (unclipped)"] = max(diffs_mb)
    # random-k: the reference's unbiased_random with a mask fed in vs the project's rand_k (float32 on the wire)
    vec = rng.normal(size=(s.d, 1))
    keep = rand_k_indices(s.d, s.k, 1234)
    with scripted_xp(s.ref, choice=lambda dim, size: np.setdiff1d(np.arange(dim), keep)):
        ref_c = s.ref.opt.unbiased_random(vec.copy(), s.k)[:, 0]
    ours_c = rand_k_decompress(rand_k_compress(vec[:, 0], s.k, 1234), s.d, 1234)
    out["random-k compressor (same mask)"] = float(np.abs(ref_c - ours_c).max())
    nb_gamma = math.sqrt((1 + 2 * s.omega) / (2 * ((1 + s.omega) ** 3)))  # notebook formula
    out["gamma"] = abs(nb_gamma - s.gamma)
    out["omega"] = abs(s.omega - rand_k_omega(s.d, default_k(s.d)))
    return out


# ----------------------------------------------------------------------------- scripted randomness
class _ScriptedRandom:
    """Stands in for ``xp.random`` in the reference modules: returns the draws we choose, in call order."""

    def __init__(self, randint: Callable[..., np.ndarray] | None = None, randn: Callable[..., np.ndarray] | None = None,
                 choice: Callable[[int, int], np.ndarray] | None = None) -> None:
        self._randint, self._randn, self._choice = randint, randn, choice

    def randint(self, low: int, high: int, size: tuple[int, int]) -> np.ndarray:
        assert self._randint is not None
        return self._randint(low, high, size)

    def randn(self, *shape: int) -> np.ndarray:
        assert self._randn is not None
        return self._randn(*shape)

    def choice(self, dim: int, size: int, replace: bool = True) -> np.ndarray:
        assert self._choice is not None and not replace
        return self._choice(dim, size)


class _XP:
    """numpy, except ``random``: the reference's array module is swappable (``xp`` = numpy or cupy)."""

    def __init__(self, random: _ScriptedRandom) -> None:
        self.random = random

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


@contextlib.contextmanager
def scripted_xp(ref: Reference, **draws: Callable[..., np.ndarray]) -> Iterator[None]:
    """Temporarily give the reference optimizer and compressor modules scripted random draws."""
    saved = ref.opt.xp, ref.comp.xp
    ref.opt.xp = ref.comp.xp = _XP(_ScriptedRandom(**draws))
    try:
        yield
    finally:
        ref.opt.xp, ref.comp.xp = saved


class _ScriptedGenerator:
    """Stands in for the client's ``np.random.Generator`` in ``client_step``: a chosen batch and noise vector."""

    def __init__(self, batch: np.ndarray, noise: np.ndarray) -> None:
        self.batch, self.noise = batch, noise

    def random(self, m: int) -> np.ndarray:
        u = np.ones(m)
        u[self.batch] = 0.0  # "u < b/m" selects exactly ``batch``
        return u

    def normal(self, loc: float, scale: float, size: int) -> np.ndarray:
        return loc + scale * self.noise


# ----------------------------------------------------------------------------- the two implementations
def make_ref_optimizer(s: Setup, method: str, *, eta: float, clip: float, sigma: float | None, batch: int,
                       rounds: int) -> Any:
    """The reference optimizer exactly as the notebook builds it (``extra_metrics`` dropped: we evaluate f)."""
    common = {"n_iters": rounds, "x_0": s.x0.copy(), "extra_metrics": [], "early_stopping": False,
              "compression": "unbiased_random_sparsification", "compression_param": s.k}
    if method == "soteriafl-sgd":
        return s.ref.opt.SoteriaFL(s.problem, eta=eta, gamma=s.gamma, local_update_method="sgd", G=clip,
                                   perturbation_variance=sigma, batch_size=batch, **common)
    if method == "cdp-sgd":
        return s.ref.opt.CDP_SGD(s.problem, eta=eta, G=clip, perturbation_variance=sigma, batch_size=batch, **common)
    raise ValueError(method)


def ref_run(s: Setup, method: str, *, eta: float, clip: float, sigma: float | None, batch: int, rounds: int,
            seed: int | None = None, trace: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """Run the reference optimizer round by round (``init``/``update`` as its ``optimize`` does); x_T, x_t's."""
    opt = make_ref_optimizer(s, method, eta=eta, clip=clip, sigma=sigma, batch=batch, rounds=rounds)
    if seed is not None:
        np.random.seed(seed)  # the reference draws from numpy's global generator
    opt.init()
    xs = []
    for opt.t in range(1, rounds + 1):
        opt.update()
        if trace:
            xs.append(np.asarray(opt.x).mean(axis=1).copy())
    return np.asarray(opt.x).mean(axis=1), xs


def ours_run(s: Setup, method: str, *, eta: float, clip: float, sigma: float, batch: int, rounds: int,
             seed: int, scripted: Callable[[int, int], tuple[np.ndarray, np.ndarray]] | None = None,
             trace: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """This project's Alg. 2 / Alg. 1 round: ``client_step`` on each client, then ``ServerState.step``.

    Own randomness: Poisson batches (q = b/m) and noise from ``default_rng([seed, 77, i])``, masks from
    ``mask_seed(fit_seed(seed, t), i)`` — as ``benchmarks/soteriafl.py`` and the Flower client do.
    ``scripted(t, i)`` → (batch indices, standard-normal noise) replaces the client's generator.
    """
    meth = METHODS[method]
    states = [ClientState() for _ in range(N_AGENT)]
    rngs = [np.random.default_rng([seed, 77, i]) for i in range(N_AGENT)]
    srv = ServerState(meth, s.d, eta, s.gamma)
    x = s.x0.copy()
    xs = []
    for t in range(1, rounds + 1):
        rseed = fit_seed(seed, t)
        msgs = []
        for i in range(N_AGENT):
            rng: Any = rngs[i] if scripted is None else _ScriptedGenerator(*scripted(t, i))
            res = client_step(meth, s.oracles[i], x, states[i], clip=clip, batch_size=batch, sigma_p=sigma, k=s.k,
                              gamma=s.gamma, rng=rng, seed=mask_seed(rseed, i), refresh_snapshot=False)
            msgs.append(res.message)
        x = srv.step(x, msgs, N_AGENT)
        if trace:
            xs.append(x.copy())
    return x, xs


# ----------------------------------------------------------------------------- part 2: identical inputs
def identical_inputs(s: Setup, method: str, *, clip: float, sigma: float, eta: float, batch: int, rounds: int,
                     seed: int = 0) -> dict[str, Any]:
    """Same batches (b distinct indices per client and round), same masks, same noise ξ = σ·z in both codes."""
    rng = np.random.default_rng([seed, 1])
    batches = [[rng.choice(s.m, batch, replace=False) for _ in range(N_AGENT)] for _ in range(rounds)]
    noise = [rng.standard_normal((s.d, N_AGENT)) for _ in range(rounds)]
    keep = [[rand_k_indices(s.d, s.k, mask_seed(fit_seed(seed, t), i)) for i in range(N_AGENT)]
            for t in range(1, rounds + 1)]
    calls = {"randint": 0, "randn": 0, "choice": 0}

    def randint(low: int, high: int, size: tuple[int, int]) -> np.ndarray:
        assert (low, high, size) == (0, s.m, (N_AGENT, batch))
        calls["randint"] += 1
        return np.stack(batches[calls["randint"] - 1])

    def randn(*shape: int) -> np.ndarray:
        assert shape == (s.d, N_AGENT)
        calls["randn"] += 1
        return noise[calls["randn"] - 1]

    def choice(dim: int, size: int) -> np.ndarray:
        t, i = divmod(calls["choice"], N_AGENT)
        calls["choice"] += 1
        return np.setdiff1d(np.arange(dim), keep[t][i])  # the reference zeroes dim − k coordinates

    with scripted_xp(s.ref, randint=randint, randn=randn, choice=choice):
        x_ref, xs_ref = ref_run(s, method, eta=eta, clip=clip, sigma=sigma if sigma > 0 else None, batch=batch,
                                rounds=rounds, trace=True)
    x_ours, xs_ours = ours_run(s, method, eta=eta, clip=clip, sigma=sigma, batch=batch, rounds=rounds, seed=seed,
                               scripted=lambda t, i: (batches[t - 1][i], noise[t - 1][:, i]), trace=True)
    per_round = [float(np.abs(a - b).max()) for a, b in zip(xs_ref, xs_ours)]
    scale = [float(np.abs(a).max()) for a in xs_ref]
    return {"method": method, "clip": clip, "sigma": sigma, "eta": eta, "batch": batch, "rounds": rounds,
            "max_abs_diff_per_round": per_round, "max_abs_x_per_round": scale,
            "first_round_above_1e-4": next((t + 1 for t, v in enumerate(per_round) if v > 1e-4), None),
            "f_ref": ref_objective(s, x_ref), "f_ours": ref_objective(s, x_ours)}


def clip_activity(s: Setup, x: np.ndarray, clip: float, batch: int, seed: int = 0) -> dict[str, float]:
    """At x: share of per-sample gradients with norm > G, share of minibatch means with norm > G."""
    rng = np.random.default_rng(seed)
    per_sample, means = [], []
    for orc in s.oracles:
        g = orc.per_sample(x, np.arange(orc.m))
        per_sample.append(np.linalg.norm(g, axis=1) > clip)
        for _ in range(20):
            means.append(np.linalg.norm(g[rng.integers(0, orc.m, batch)].mean(0)) > clip)
    return {"per_sample_clipped": float(np.mean(np.concatenate(per_sample))), "batch_mean_clipped": float(np.mean(means))}


# ----------------------------------------------------------------------------- part 3: own randomness
def t_interval(values: list[float]) -> tuple[float, float]:
    """Mean and 95 % half-width (Student t) over seeds: the sweep reports' ``fedapp.experiments.report.interval``."""
    mean, half, _ = interval(values)
    return mean, half


def theorem2_notebook_sigma(c: float, rounds: int, m: int) -> float:
    """The notebook's ``perturbation_variance`` (used as a std): sqrt(c G² T log(1/δ) / (m² ε²))."""
    return math.sqrt(c * G_PAPER**2 * rounds * (-math.log(DELTA)) / (m**2 * EPS**2))


def notebook_epsilon(sigma: float, batch: int, m: int, rounds: int) -> float:
    """ε (RDP accountant, δ = 1e-3) that σ would spend with *per-sample* clipping and Poisson sampling, q = b/m."""
    return float(epsilon_of(noise_history("sgd", sigma, G_PAPER, batch, m, rounds), DELTA, "rdp"))


def settings(s: Setup) -> list[dict[str, Any]]:
    """The notebook's ε = 5 cell (its η and c; then η equalized) and the project's quick sweep (two data scales)."""
    b = default_batch_size("sgd", s.m, epsilon=EPS, delta=DELTA, clip=G_PAPER, d=s.d, omega=s.omega, n=N_AGENT)
    acc40 = calibrate_sigma("sgd", EPS, DELTA, G_PAPER, b, s.m, 40)[0]
    nb12, nb8 = theorem2_notebook_sigma(12, 100, s.m), theorem2_notebook_sigma(8, 100, s.m)
    quick = {"rounds": 40, "batch": b, "clip": G_PAPER, "soteriafl-sgd": {"eta": 0.1, "sigma": acc40},
             "cdp-sgd": {"eta": 0.1, "sigma": acc40}}
    return [
        {"name": "notebook eps=5 cell (T=100, eta 0.3/0.1, c=12/8)", "data": "reference", "rounds": 100, "batch": b,
         "clip": G_PAPER, "soteriafl-sgd": {"eta": 0.3, "sigma": nb12}, "cdp-sgd": {"eta": 0.1, "sigma": nb8}},
        {"name": "notebook sigma, equal eta 0.1 (T=100)", "data": "reference", "rounds": 100, "batch": b,
         "clip": G_PAPER, "soteriafl-sgd": {"eta": 0.1, "sigma": nb12}, "cdp-sgd": {"eta": 0.1, "sigma": nb8}},
        {"name": "quick-sweep parameters (T=40, eta=0.1, accountant sigma), reference data", "data": "reference",
         **quick},
        {"name": "quick-sweep parameters, raw features + torch-init x0 (the sweep's inputs)", "data": "raw", **quick},
        {"name": "as the previous row, clipping off (G=1e6; diagnostic, no DP)", "data": "raw", **quick, "clip": 1e6},
    ]


def own_randomness(setups: dict[str, Setup], seeds: list[int], chosen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Final f(x_T) per seed for both codes × {SoteriaFL-SGD, CDP-SGD}, and SoteriaFL − CDP per seed."""
    rows = []
    for st in chosen:
        s = setups[st["data"]]
        finals: dict[str, list[float]] = {}
        test: dict[str, list[float]] = {}
        for impl in ("reference", "ours"):
            for method in ("soteriafl-sgd", "cdp-sgd"):
                par = st[method]
                vals, tests = [], []
                t0 = time.perf_counter()
                for seed in seeds:
                    run = ref_run if impl == "reference" else ours_run
                    x, _ = run(s, method, eta=par["eta"], clip=st["clip"], sigma=par["sigma"], batch=st["batch"],
                               rounds=st["rounds"], seed=seed)
                    vals.append(ref_objective(s, x))
                    tests.append(test_loss(s, x))
                finals[f"{impl}/{method}"] = vals
                if st["data"] == "raw":
                    test[f"{impl}/{method}"] = tests
                print(f"  [{st['name']}] {impl:9s} {method:13s} η={par['eta']} σ={par['sigma']:.4g}: "
                      f"f_T = {fmt(vals)} ({time.perf_counter() - t0:.0f}s)", flush=True)
        for impl in ("reference", "ours"):
            finals[f"{impl}/soteriafl-minus-cdp"] = [a - b for a, b in zip(finals[f"{impl}/soteriafl-sgd"],
                                                                            finals[f"{impl}/cdp-sgd"])]
        for method in ("soteriafl-sgd", "cdp-sgd"):
            finals[f"ours-minus-reference/{method}"] = [a - b for a, b in zip(finals[f"ours/{method}"],
                                                                               finals[f"reference/{method}"])]
        eps = {m: notebook_epsilon(st[m]["sigma"], st["batch"], s.m, st["rounds"]) for m in ("soteriafl-sgd", "cdp-sgd")}
        rows.append({"setting": st["name"], "data": st["data"], "rounds": st["rounds"], "batch": st["batch"],
                     "clip": st["clip"], "params": {m: st[m] for m in ("soteriafl-sgd", "cdp-sgd")},
                     "accountant_epsilon": eps, "seeds": seeds, "f_x0": ref_objective(s, s.x0), "final_f": finals,
                     "final_test_loss": test})
    return rows


def fmt(values: list[float], digits: int = 4) -> str:
    mean, hw = t_interval(values)
    return f"{mean:.{digits}f} ± {hw:.{digits}f}"


# ----------------------------------------------------------------------------- main
def describe(s: Setup) -> dict[str, Any]:
    train_scale, test_scale = feature_scale(s.problem)
    row_norm = float(np.linalg.norm(np.asarray(s.problem.X_train)[:, :-1], axis=1).mean())
    b = default_batch_size("sgd", s.m, epsilon=EPS, delta=DELTA, clip=G_PAPER, d=s.d, omega=s.omega, n=N_AGENT)
    info = {"data": s.data, "d": s.d, "m": s.m, "k": s.k, "omega": s.omega, "gamma": s.gamma, "batch": b,
            "train_feature_factor": train_scale, "test_feature_factor": test_scale, "mean_train_row_norm": row_norm,
            "label_share_per_client": [round(float(np.mean(y)), 3) for y in s.problem.Y], "f_x0": ref_objective(s, s.x0),
            "clip_activity_x0": clip_activity(s, s.x0, G_PAPER, b)}
    print(f"[{s.data} data] d = {s.d}, m = {s.m}/client, k = {s.k}, ω = {s.omega:.3f}, γ = {s.gamma:.4f}, b = {b}; "
          f"feature factor train {train_scale:.4f} test {test_scale:.4f}; mean train row norm {row_norm:.3f}; "
          f"f(x0) = {info['f_x0']:.4f}; clipped at x0 (G = 0.5): {info['clip_activity_x0']}", flush=True)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref-path", default="/tmp/ref/soteriafl", help="checkout of haoyuzhao123/soteriafl")
    ap.add_argument("--nda-path", default="/tmp/ref/nda", help="checkout of liboyue/Network-Distributed-Algorithm")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"), help="folder with a9a and a9a.t")
    ap.add_argument("--seeds", type=int, default=10, help="seeds of part 3 (1..N)")
    ap.add_argument("--rounds-identical", type=int, default=40, help="rounds of part 2")
    ap.add_argument("--parts", default="1,2,3")
    ap.add_argument("--settings", default="0,1,2,3,4", help="part-3 settings (indices into settings())")
    ap.add_argument("--json", default="", help="write every number to this file")
    args = ap.parse_args()
    try:
        ref = load_reference(Path(args.ref_path), Path(args.nda_path), Path(args.data_dir))
    except (FileNotFoundError, ImportError) as exc:
        print(f"SKIP: reference code not found ({exc}). Extract github.com/haoyuzhao123/soteriafl to --ref-path and "
              "github.com/liboyue/Network-Distributed-Algorithm to --nda-path.")
        return
    torch.set_num_threads(1)
    parts = {int(p) for p in args.parts.split(",") if p}
    t0 = time.perf_counter()
    setups = {data: make_setup(ref, data) for data in ("reference", "raw")}
    out: dict[str, Any] = {"setups": {data: describe(s) for data, s in setups.items()}}
    s = setups["reference"]
    b = out["setups"]["reference"]["batch"]
    if 1 in parts:
        out["building_blocks"] = building_blocks(s)
        print("part 1: building blocks, max |reference − ours| (reference data):")
        for name, v in out["building_blocks"].items():
            print(f"  {name:34s} {v:.3g}")
    if 2 in parts:
        out["identical"] = []
        sig = settings(s)[2]["soteriafl-sgd"]["sigma"]
        print(f"part 2: identical inputs, T = {args.rounds_identical}, b = {b}, η = 0.1, σ ∈ {{0, {sig:.4g}}}")
        for data, st in setups.items():
            for method in ("soteriafl-sgd", "cdp-sgd"):
                for clip, sigma in ((1e6, 0.0), (1e6, sig), (G_PAPER, 0.0), (G_PAPER, sig)):
                    r = identical_inputs(st, method, clip=clip, sigma=sigma, eta=0.1, batch=b,
                                         rounds=args.rounds_identical)
                    r["data"] = data
                    out["identical"].append(r)
                    d = r["max_abs_diff_per_round"]
                    print(f"  [{data}] {method:13s} G={clip:<7g} σ={sigma:<8.4g} max|Δx| round 1 {d[0]:.2e}, "
                          f"round 10 {d[min(9, len(d) - 1)]:.2e}, final {d[-1]:.2e} (max|x| "
                          f"{r['max_abs_x_per_round'][-1]:.2f}); f_T ref {r['f_ref']:.6f} ours {r['f_ours']:.6f}",
                          flush=True)
    if 3 in parts:
        chosen = [settings(s)[int(i)] for i in args.settings.split(",") if i]
        seeds = list(range(1, args.seeds + 1))
        print(f"part 3: own randomness, seeds {seeds[0]}..{seeds[-1]}")
        out["own_randomness"] = own_randomness(setups, seeds, chosen)
        for row in out["own_randomness"]:
            print(f"  {row['setting']} (f(x0) = {row['f_x0']:.4f}; accountant ε of σ: {row['accountant_epsilon']}):")
            for key, vals in row["final_f"].items():
                print(f"    {key:36s} {fmt(vals)}")
            for key, vals in row["final_test_loss"].items():
                print(f"    test loss {key:26s} {fmt(vals)}")
    out["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"done in {out['seconds']:.0f}s")


if __name__ == "__main__":
    main()
