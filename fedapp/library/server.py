"""Strategies of :mod:`strategies` built from typed arguments, for a user's own ServerApp.

Each builder returns the library's own Flower ``Strategy`` (run it with ``flwr.server.compat.start_grid`` from a
``ServerApp``'s ``@app.main()``); its threat model is the strategy's ``privacy`` attribute. The clients must be the
matching ones of :mod:`fedapp.library.clients`: record-level DP-SGD clients for :func:`robust_hdp` and
:func:`dpsgd_fedavg`, client-level clients for :func:`dp_fedavg`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from fedapp.clients.training import get_weights, resolve_device, set_weights
from fedapp.library.data import UserData, as_array_dataset
from fedapp.library.evaluation import Loss, evaluate_user_model
from fedapp.library.settings import DPSGDSettings, Rounds
from strategies.engine import EvaluateFn
from strategies.fed_smp import ClientLevelStrategy
from strategies.fedavg import DPSGDFedAvg, FedAvg
from strategies.privacy.mechanisms import ClientLevelDP, default_client_delta, max_delta
from strategies.robust_hdp import RobustHDP
from strategies.server.records import RoundRecorder

Weights = Sequence[np.ndarray] | nn.Module


def _engine(initial: Weights, rounds: Rounds, evaluate_fn: EvaluateFn | None, recorder: RoundRecorder | None,
            accountant: str) -> dict[str, Any]:
    weights = get_weights(initial) if isinstance(initial, nn.Module) else [np.asarray(w) for w in initial]
    sizes = rounds.client_sizes
    return {"initial_weights": weights, "evaluate_fn": evaluate_fn, "recorder": recorder,
            "num_rounds": rounds.num_rounds, "seed": rounds.seed, "clients_per_round": rounds.clients_per_round,
            "min_available_clients": rounds.min_available_clients, "fraction_evaluate": rounds.fraction_evaluate,
            "evaluate_every": rounds.evaluate_every, "server_lr": rounds.server_lr, "secret_sampling": True,
            "accountant": accountant, "strike_limit": rounds.strike_limit,
            "robust_norm_factor": rounds.robust_norm_factor,
            "dataset_sizes": (lambda n: list(sizes)) if sizes is not None else None}


def fedavg(initial: Weights, rounds: Rounds, *, evaluate_fn: EvaluateFn | None = None,
           recorder: RoundRecorder | None = None) -> FedAvg:
    """FedAvg (w_i ∝ N_i) over non-private updates: no privacy. Clients: ``dpsgd_client(..., private=False)``."""
    return FedAvg(**_engine(initial, rounds, evaluate_fn, recorder, "rdp"))


def dpsgd_fedavg(initial: Weights, rounds: Rounds, dpsgd: DPSGDSettings, *, evaluate_fn: EvaluateFn | None = None,
                 recorder: RoundRecorder | None = None) -> DPSGDFedAvg:
    """DP-FedAvg over record-level DP-SGD clients (w_i ∝ N_i); an update above what the client's declared DP-SGD and
    ``dpsgd``'s clip, schedule and momentum produce is rejected. Privacy: each client's records, (ε_i, δ_i) against
    anyone who sees its updates, the server included."""
    return DPSGDFedAvg(clip_norm=dpsgd.clip_norm, momentum=dpsgd.momentum, lr_schedule=dpsgd.lr_schedule(),
                       **_engine(initial, rounds, evaluate_fn, recorder, dpsgd.accountant))


def robust_hdp(initial: Weights, rounds: Rounds, dpsgd: DPSGDSettings, *, evaluate_fn: EvaluateFn | None = None,
               recorder: RoundRecorder | None = None, max_weight_share: float = 0.5, freeze_weights: bool = False,
               rpca_tol: float = 1e-4) -> RobustHDP:
    """Robust-HDP (Malekmohammadi et al. 2024, Alg. 1): weights w_i ∝ 1/σ̂_i² from Robust PCA of the round's
    updates, never from a client's reported ε; an update whose estimated noise is outside the band its declared DP-SGD
    implies is rejected. Same privacy as :func:`dpsgd_fedavg` (record-level, local, untrusted server)."""
    return RobustHDP(rpca_options={"tol": rpca_tol}, freeze_weights=freeze_weights, clip_norm=dpsgd.clip_norm,
                     max_weight_share=max_weight_share, lr_schedule=dpsgd.lr_schedule(), momentum=dpsgd.momentum,
                     **_engine(initial, rounds, evaluate_fn, recorder, dpsgd.accountant))


def client_level_mechanism(*, num_clients: int, rounds: int, clip: float, target_epsilon: float | None = None,
                           noise_multiplier: float | None = None, delta: float | None = None,
                           clients_per_round: int = 0, accountant: str = "rdp",
                           allow_large_delta: bool = False) -> ClientLevelDP:
    """The client-level Gaussian mechanism of :func:`dp_fedavg` without secure aggregation: the server sees every
    update, so σ is calibrated for one update's ε (each client adds N(0, C²σ²/r)).

    Exactly one of ``target_epsilon`` (σ calibrated so ``rounds`` rounds spend it) and ``noise_multiplier`` (σ given).
    ``delta`` defaults to 1/(10 n); a larger one is refused unless ``allow_large_delta``. ε holds against the server, which draws the sample and sees who replies: every round
    is charged unamplified (q = 1), the project's default adversary (no amplification by sampling is claimed). Server
    and clients must build it from the same arguments: a client refuses a round whose σ differs from its own."""
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of target_epsilon and noise_multiplier")
    r = clients_per_round or num_clients
    delta = default_client_delta(num_clients) if delta is None else delta
    if delta > max_delta(num_clients) and not allow_large_delta:
        raise ValueError(f"delta = {delta:g} is above 1/(10 n) = {max_delta(num_clients):.3g} for n = {num_clients} "
                         "clients; pass allow_large_delta=True to use it anyway")
    if noise_multiplier is not None:
        return ClientLevelDP(noise_multiplier, clip, r, num_clients, rounds, delta, accountant, False, "server")
    assert target_epsilon is not None
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon = {target_epsilon} must be a finite number > 0")
    return ClientLevelDP.calibrated(target_epsilon, clip=clip, clients_per_round=r, num_clients=num_clients,
                                    rounds=rounds, delta=delta, accountant=accountant, secure_aggregation=False,
                                    adversary="server")


def dp_fedavg(initial: Weights, rounds: Rounds, mechanism: ClientLevelDP, *, evaluate_fn: EvaluateFn | None = None,
              recorder: RoundRecorder | None = None) -> ClientLevelStrategy:
    """DP-FedAvg with client-level DP (McMahan et al. 2018; Fed-SMP's dense case): clients clip their update to C and
    add their noise share; the server samples clients by secret Poisson sampling at q = r/n, averages and keeps its own
    ledger of each client's ε. Without SecAgg+ (not available through this library): ``mechanism`` must have
    ``secure_aggregation = False`` (:func:`client_level_mechanism`). ``rounds.clients_per_round`` must equal the
    mechanism's r (0 when r = n)."""
    if mechanism.secure_aggregation:
        raise ValueError("mechanism.secure_aggregation = True needs the project's SecAgg+ workflow (fedapp.apps); the "
                         "library runs without it: build the mechanism with client_level_mechanism(...)")
    if (rounds.clients_per_round or mechanism.num_clients) != mechanism.clients_per_round:
        raise ValueError(f"rounds.clients_per_round = {rounds.clients_per_round} but the mechanism is planned for "
                         f"r = {mechanism.clients_per_round} of n = {mechanism.num_clients}")
    num_clients = mechanism.num_clients

    def factory(n: int) -> ClientLevelDP:
        if n != num_clients:
            raise ValueError(f"{n} clients connected; the client-level mechanism is planned for n = {num_clients}")
        return mechanism

    return ClientLevelStrategy(mechanism_factory=factory, clip=mechanism.clip, secure_aggregation=False,
                               name="dp-fedavg", **_engine(initial, rounds, evaluate_fn, recorder, mechanism.accountant))


def central_evaluation(model: nn.Module, test: UserData, *, loss: Loss | None = None, batch_size: int = 256,
                       device: str = "cpu") -> EvaluateFn:
    """The server's evaluation of the global weights on held-out ``test`` data: (mean loss, {"accuracy": ...}) with
    ``loss`` (None: cross-entropy); accuracy when the model's outputs are class scores and the labels integers."""
    data = as_array_dataset(test, "test")
    torch_device = resolve_device(device)

    def evaluate(weights: list[np.ndarray]) -> tuple[float, dict[str, Any]]:
        set_weights(model, weights)
        mean_loss, accuracy = evaluate_user_model(model, data, loss, batch_size, torch_device)
        return mean_loss, ({} if accuracy is None else {"accuracy": accuracy})

    return evaluate


class JsonRecorder:
    """A :class:`~strategies.server.records.RoundRecorder` writing ``rounds.jsonl`` (one record per round: metrics
    and every client's status, the server's ε for it and any reason) and, after the last round, ``summary.json`` into ``folder``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.rounds: list[dict[str, Any]] = []

    def open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "rounds.jsonl").write_text("", encoding="utf-8")

    def write_round(self, record: dict[str, Any]) -> None:
        self.rounds.append(record)
        with (self.folder / "rounds.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def finish(self) -> None:
        (self.folder / "summary.json").write_text(json.dumps(self.summary(), indent=2), encoding="utf-8")

    def summary(self) -> dict[str, Any]:
        """Rounds completed, the last round's metrics and, per client id, the largest ε the server's own ledger
        charged it (composed from the mechanism each reply declared, never the client's claim)."""
        spent: dict[str, float] = {}
        for record in self.rounds:
            for client in record.get("clients", []):
                eps = client.get("epsilon_spent")
                if isinstance(eps, (int, float)) and client.get("client_id") is not None:
                    key = str(client["client_id"])
                    spent[key] = max(spent.get(key, 0.0), float(eps))
        last = self.rounds[-1] if self.rounds else {}
        return {"rounds_completed": len(self.rounds), "final_metrics": last.get("metrics", {}),
                "epsilon_spent_by_client": spent}


__all__ = ["JsonRecorder", "central_evaluation", "client_level_mechanism", "dp_fedavg", "dpsgd_fedavg", "fedavg",
           "robust_hdp"]
