"""The pfl-research side of ``benchmarks/peer_pfl.py``: DP-FedAvg with pfl's central Gaussian mechanism.

Runs in pfl's own virtual environment and imports only numpy, torch and pfl (never flwr or fedapp).
It reads what ``peer_pfl.py`` exported (``--inputs``): the training pool, the per-client index sets
of this project's partition, the held-out test set, the Table-5 CNN's initial weights and the
settings, and trains with pfl's own pieces as its documentation shows them:

* ``FederatedDataset`` over the 20 clients; each time a client is sampled its data is shuffled once
  (the project's clients reshuffle every round as well);
* ``PyTorchModel`` with a local ``torch.optim.SGD`` (1 local epoch, batch b, learning rate η) and a
  central SGD with learning rate ``server_lr`` (θ ← θ + server_lr · mean update);
* ``FederatedAveraging`` with ``WeightByUser`` (uniform weights, as DP-FedAvg) and
  ``CentrallyAppliedPrivacyMechanism(GaussianMechanism(C, σ))``: every update is clipped to C and the
  server adds N(0, σ²C²) to their sum before averaging;
* central evaluation on the held-out test set of the initial model and after every round, as the
  project's server does (a small callback on ``PyTorchModel.evaluate``: pfl's ``CentralEvaluationCallback``
  skips the evaluation after the first iteration), and a timer callback for per-round wall times, with
  each round's local training (per user) and central evaluation timed inside it;
* no per-user evaluation: pfl evaluates every sampled user on its own data before and after local
  training in iterations that are multiples of ``evaluation_frequency`` (iteration 0 included); the
  project's run does no federated evaluation (``fraction-evaluate = 0``), so it is switched off here.

Client sampling (``--sampling``): ``paired`` (default) trains cohorts of exactly the sizes r_1, …, r_T that
the project's server draws for the same run seed (``cohort_sizes`` in the exported settings), each a uniform
subset of distinct clients, so both sides train the same number of clients in every round; ``poisson`` draws
r_t ~ Binomial(n, q) each round and a uniform subset of that size, which is Poisson sampling with rate q = r/n
like the project's server (pfl has no built-in Poisson sampler; an adaptive cohort size is pfl's documented
``HyperParam`` use); ``fixed`` takes exactly r distinct clients; ``random`` and ``minimize_reuse`` are pfl's
built-in user samplers (``random`` draws with replacement, so a cohort may repeat a client).

``--channels-last`` lays the CNN's weights out channels-last, as this project's local loop and evaluation do on a
CPU (``fedapp.models.zoo``): pfl given the same layout, to separate the layout's speed from the frameworks'.

    /work/pfl-venv/bin/python benchmarks/pfl_side.py --inputs DIR --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import HyperParam, NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, StringMetricName, Weighted
from pfl.model.pytorch import PyTorchModel
from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism
from torch import nn

SAMPLINGS = ("paired", "poisson", "fixed", "random", "minimize_reuse")


class MnistCNN(nn.Module):
    """The project's Table-5 CNN (``fedapp.models.zoo.MnistCNN``), same layers and parameter names, plus the
    ``loss``/``metrics`` methods ``PyTorchModel`` calls."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.fc = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002 - pfl's name
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y.long())  # pfl hands NumPy labels over as float tensors

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Weighted]:  # noqa: A002
        self.eval() if eval else self.train()
        logits = self(x)
        n, y = len(y), y.long()
        return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n)}


class PoissonCohort(HyperParam, TrainingProcessCallback):
    """Cohort size r_t ~ Binomial(n, q), redrawn after every central iteration (a round of 0 is redrawn:
    probability (1 − q)^n, 1e-6 for n = 20, q = 0.5)."""

    def __init__(self, n: int, q: float, rng: np.random.Generator) -> None:
        self._n, self._q, self._rng = n, q, rng
        self._value = self._draw()

    def _draw(self) -> int:
        while True:
            r = int(self._rng.binomial(self._n, self._q))
            if r > 0:
                return r

    def value(self) -> int:
        return self._value

    def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        self._value = self._draw()
        return False, Metrics()


class CohortSchedule(HyperParam, TrainingProcessCallback):
    """Cohort size r_t from a given list, one entry per central iteration (the sizes the project's server draws)."""

    def __init__(self, sizes: list[int]) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cohort sizes must be positive, got {sizes}")
        self._sizes, self._t = [int(s) for s in sizes], 0

    def value(self) -> int:
        return self._sizes[min(self._t, len(self._sizes) - 1)]

    def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        self._t += 1
        return False, Metrics()


class DistinctCohortSampler:
    """pfl user sampler (``callable() -> user_id``): each cohort of ``size()`` users is a uniform subset of
    distinct users (pfl asks for exactly one cohort's worth of users per round)."""

    def __init__(self, user_ids: list[int], size: Callable[[], int], rng: np.random.Generator) -> None:
        self._ids, self._size, self._rng = np.asarray(user_ids), size, rng
        self._queue: list[int] = []

    def __call__(self) -> int:
        if not self._queue:
            self._queue = [int(u) for u in self._rng.permutation(self._ids)[:self._size()]]
        return self._queue.pop(0)


class NoUserEvaluation(FederatedAveraging):
    """FederatedAveraging without pfl's per-user evaluation before and after local training; it times each user's
    local training (``train_one_user``: pfl's SGD loop and the model difference) into ``train_seconds``."""

    def __init__(self) -> None:
        super().__init__()
        self.train_seconds: list[float] = []  # the users of the central iteration in progress

    def simulate_one_user(self, model: Any, user_dataset: Any, central_context: Any) -> tuple[Any, Metrics]:
        return super().simulate_one_user(model, user_dataset, dataclasses.replace(central_context, do_evaluation=False))

    def train_one_user(self, initial_model_state: Any, model: Any, user_dataset: Any,
                       central_context: Any) -> tuple[Any, Metrics]:
        start = time.perf_counter()
        try:
            return super().train_one_user(initial_model_state, model, user_dataset, central_context)
        finally:
            self.train_seconds.append(time.perf_counter() - start)


class CentralTestEvaluation(TrainingProcessCallback):
    """Loss and accuracy of the global model on the held-out test set: the initial model (kept in
    ``initial``) and after every central iteration (as ``Central test | ...`` metrics)."""

    def __init__(self, dataset: Dataset, eval_params: NNEvalHyperParams) -> None:
        self.dataset, self.eval_params = dataset, eval_params
        self.initial: dict[str, float] = {}
        self.seconds = 0.0  # the last evaluation's

    def _evaluate(self, model: PyTorchModel) -> Metrics:
        start = time.perf_counter()
        metrics = model.evaluate(self.dataset, lambda n: StringMetricName(f"Central test | {n}"), self.eval_params)
        self.seconds = time.perf_counter() - start
        return metrics

    def on_train_begin(self, *, model: PyTorchModel) -> Metrics:
        self.initial = self._evaluate(model).to_simple_dict()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics: Metrics, model: PyTorchModel, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        return False, self._evaluate(model)


#: output lines of :class:`RoundTimer`: training begins (after the initial evaluation); a central iteration ended
TRAIN_BEGINS = "[pfl_side] round 1 begins"
ROUND_ENDED = "[pfl_side] round ended:"


class RoundTimer(TrainingProcessCallback):
    """Wall time of every central iteration (including the evaluation of callbacks listed before it) and
    the central test metrics; listed last, its ``on_train_begin`` runs after the initial evaluation. Given the
    ``algorithm`` and the ``central`` evaluation, a round's record also holds its users' local training seconds
    (``train_seconds``) and the central evaluation's (``evaluate_seconds``)."""

    def __init__(self, algorithm: NoUserEvaluation | None = None, central: CentralTestEvaluation | None = None) -> None:
        self.rounds: list[dict[str, Any]] = []
        self._start = self._last = 0.0
        self.algorithm, self.central = algorithm, central

    def on_train_begin(self, *, model: Any) -> Metrics:
        self._start = self._last = time.perf_counter()
        print(TRAIN_BEGINS, flush=True)  # peer_pfl.py times the start-up against this line
        return Metrics()

    def after_central_iteration(self, aggregate_metrics: Metrics, model: Any, *,
                                central_iteration: int) -> tuple[bool, Metrics]:
        now = time.perf_counter()
        flat = aggregate_metrics.to_simple_dict()
        self.rounds.append({
            "round": central_iteration + 1, "wall_seconds": now - self._last, "elapsed_seconds": now - self._start,
            "accuracy": flat.get("Central test | accuracy"), "loss": flat.get("Central test | loss"),
            "clients": flat.get("Train population | number of devices"),
        })
        if self.algorithm is not None:
            self.rounds[-1]["train_seconds"] = list(self.algorithm.train_seconds)
            self.algorithm.train_seconds.clear()
        if self.central is not None:
            self.rounds[-1]["evaluate_seconds"] = self.central.seconds
        self._last = now
        print(f"{ROUND_ENDED} {central_iteration + 1}", flush=True)  # and the teardown against the last one
        return False, Metrics()


def load_inputs(folder: Path) -> dict[str, Any]:
    """Everything ``peer_pfl.py`` exported, as tensors."""
    clients = np.load(folder / "clients.npz")
    init = np.load(folder / "init_weights.npz")
    return {
        "settings": json.loads((folder / "settings.json").read_text(encoding="utf-8")),
        "x": torch.from_numpy(np.load(folder / "train_x.npy")),
        "y": torch.from_numpy(np.load(folder / "train_y.npy")),
        "test_x": torch.from_numpy(np.load(folder / "test_x.npy")),
        "test_y": torch.from_numpy(np.load(folder / "test_y.npy")),
        "clients": [torch.from_numpy(clients[f"client_{i}"]) for i in range(len(clients.files))],
        "init": {k: torch.from_numpy(init[k]) for k in init.files},
    }


def user_sampler(kind: str, user_ids: list[int], cohort: int | PoissonCohort | CohortSchedule,
                 rng: np.random.Generator) -> Callable[[], int]:
    if kind in ("paired", "poisson", "fixed"):
        size = cohort.value if isinstance(cohort, (PoissonCohort, CohortSchedule)) else (lambda: int(cohort))
        return DistinctCohortSampler(user_ids, size, rng)
    return get_user_sampler(kind, user_ids)


def run(inputs: dict[str, Any], sampling: str, seed: int | None, channels_last: bool = False) -> dict[str, Any]:
    """Train as the settings say; returns per-round records and the final central accuracy."""
    s = inputs["settings"]
    n, r, rounds = int(s["num_clients"]), int(s["clients_per_round"]), int(s["rounds"])
    rng = np.random.default_rng(seed)
    if seed is not None:
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
    x, y, parts = inputs["x"], inputs["y"], inputs["clients"]

    def make_user(uid: int) -> Dataset:
        idx = parts[uid][torch.randperm(len(parts[uid]))]  # shuffled once per participation
        return Dataset(raw_data=[x[idx], y[idx]], user_id=uid)

    cohort: int | PoissonCohort | CohortSchedule = r
    if sampling == "poisson":
        cohort = PoissonCohort(n, r / n, rng)
    elif sampling == "paired":
        cohort = CohortSchedule(list(s["cohort_sizes"]))
    users = list(range(n))
    train_data = FederatedDataset(make_user, user_sampler(sampling, users, cohort, rng))
    val_data = FederatedDataset(make_user, get_user_sampler("random", users))  # never sampled (no val cohort)

    module = MnistCNN()
    module.load_state_dict(inputs["init"], strict=True)  # the project's initial weights, by parameter name
    if channels_last:
        module.to(memory_format=torch.channels_last)
    model = PyTorchModel(model=module,
                         local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=float(s["server_lr"])))
    mechanism = CentrallyAppliedPrivacyMechanism(
        GaussianMechanism(clipping_bound=float(s["clip_norm"]), relative_noise_stddev=float(s["noise_multiplier"])))
    backend = SimulatedBackend(training_data=train_data, val_data=val_data,
                               postprocessors=[WeightByUser(), mechanism])
    algorithm_params = NNAlgorithmParams(central_num_iterations=rounds,
                                         evaluation_frequency=1,  # user evaluation is off (NoUserEvaluation)
                                         train_cohort_size=cohort, val_cohort_size=None)
    train_params = NNTrainHyperParams(local_learning_rate=float(s["lr"]), local_num_epochs=int(s["local_epochs"]),
                                      local_batch_size=int(s["batch_size"]))
    eval_params = NNEvalHyperParams(local_batch_size=int(s["eval_batch_size"]))
    algorithm = NoUserEvaluation()
    central = CentralTestEvaluation(Dataset(raw_data=[inputs["test_x"], inputs["test_y"]]), eval_params)
    timer = RoundTimer(algorithm, central)
    callbacks: list[TrainingProcessCallback] = [central]
    if isinstance(cohort, (PoissonCohort, CohortSchedule)):
        callbacks.append(cohort)
    callbacks.append(timer)  # last: its round time includes the central evaluation
    algorithm.run(algorithm_params=algorithm_params, backend=backend, model=model,
                  model_train_params=train_params, model_eval_params=eval_params, callbacks=callbacks)
    return {"rounds": timer.rounds, "final_accuracy": timer.rounds[-1]["accuracy"] if timer.rounds else None,
            "initial": {"accuracy": central.initial.get("Central test | accuracy"),
                        "loss": central.initial.get("Central test | loss")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=Path, required=True, help="folder written by benchmarks/peer_pfl.py")
    parser.add_argument("--out", type=Path, required=True, help="JSON result file")
    parser.add_argument("--sampling", choices=SAMPLINGS, default="paired")
    parser.add_argument("--seed", type=int, default=None, help="seed of sampling, shuffling and noise (default: random)")
    parser.add_argument("--channels-last", action="store_true", help="the CNN's weights channels-last")
    args = parser.parse_args(argv)
    import pfl

    t0 = time.perf_counter()
    inputs = load_inputs(args.inputs)
    load_seconds = time.perf_counter() - t0
    result = run(inputs, args.sampling, args.seed, args.channels_last)
    result.update(load_seconds=load_seconds, sampling=args.sampling, channels_last=args.channels_last,
                  pfl_version=pfl.__version__,
                  torch_version=torch.__version__, torch_threads=torch.get_num_threads())
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
