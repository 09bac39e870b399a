"""Client-level DP client (DP-FedAvg, Fed-SMP Alg. 1–2; reusable by DP2-FedSAM).

What it protects: the whole local dataset of this client (client-level DP). Each round the
client runs τ local momentum-SGD steps from the global model θ (momentum reset every round,
η decayed per round, Fed-SMP Sec. 6.2), forms Δ = θ_local − θ, then

* dense (``dp-fedavg``): clips Δ to C and adds N(0, C²σ²/r) (Alg. 1 lines 21–22);
* sparse (``fed-smp-*``): DP-spar with the round's server mask (Alg. 2 lines 44–51) and sends
  only the k masked values (``strategies.fed_smp.encode_sparse``);
* non-private (``fedavg-randk/topk``): the same sparsify + clip, no noise.

The noise is sized so that the *sum* over the r sampled clients carries σC; the ε reported
is that of the sum (secure-aggregation threat model; see ``strategies/fed_smp.py``). σ comes
from ``strategies.client_dp.mechanism_from_config`` — the same function the server uses —
and a client refuses to train in a round whose ε would exceed the planned budget ε(T).

Reuse (DP2-FedSAM): subclass :class:`ClientLevelDPClient` and override :meth:`local_train`
(e.g. a SAM optimizer); clipping, noise, masks, budget refusal and metrics stay here.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from flwr.client import Client, NumPyClient
from flwr.common import Context
from torch import nn

from fedapp.clients.common import ClientSetup, evaluate_on_local_test, noise_seed, round_lr, round_seed, setup_client
from fedapp.config import RunConfig
from fedapp.data import ArrayDataset
from fedapp.training import TrainResult, get_weights, set_weights, steps_per_epoch
from strategies.aggregate import flatten, unflatten
from strategies.client_dp import ClientLevelDP, cached_epsilon, mechanism_from_config
from strategies.fed_smp import CFG_SIGMA, dp_dense, dp_spar, encode_sparse, mask_from_config

EPS_SLACK = 1e-9


def local_steps(cfg: RunConfig, num_examples: int, batch_size: int) -> int:
    """τ: ``local-steps`` if set, else ``local-epochs`` · ⌈N/b⌉."""
    return int(cfg["local-steps"]) or int(cfg["local-epochs"]) * steps_per_epoch(num_examples, batch_size)


def train_local_steps(model: nn.Module, data: ArrayDataset, *, batch_size: int, steps: int, lr: float,
                      momentum: float = 0.0, device: torch.device | None = None, seed: int = 0) -> TrainResult:
    """τ = ``steps`` minibatch momentum-SGD steps (fresh optimizer, so momentum starts at 0 each round).

    Minibatches walk through seeded shuffles of the data (a new shuffle per pass, last partial
    batch kept), so τ = ⌈N/b⌉ steps is exactly one epoch.
    """
    device = device or torch.device("cpu")
    model.to(device).train()
    rng = np.random.default_rng(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    x_all, y_all = torch.from_numpy(data.x), torch.from_numpy(data.y)
    start, total, order, pos = time.perf_counter(), 0.0, np.empty(0, dtype=np.int64), 0
    for _ in range(steps):
        if pos >= len(order):
            order, pos = rng.permutation(len(data)), 0
        idx = torch.from_numpy(order[pos:pos + batch_size])
        pos += batch_size
        xb, yb = x_all[idx].to(device), y_all[idx].to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        reg = getattr(model, "regularization", None)
        if callable(reg):
            loss = loss + reg()
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return TrainResult(steps, total / max(steps, 1), time.perf_counter() - start)


class ClientLevelDPClient(NumPyClient):
    """Local training + client-level clip/noise (+ optional Fed-SMP mask) for one client."""

    def __init__(self, setup: ClientSetup, context: Context | None = None, private: bool = True) -> None:
        self.s = setup
        self.context = context
        self.private = private

    # ---- privacy ---------------------------------------------------------------------
    def mechanism(self) -> ClientLevelDP | None:
        """The run's client-level mechanism (None for the non-private baselines)."""
        if not self.private:
            return None
        return mechanism_from_config(self.s.cfg, self.s.profile.num_clients)

    def budget_check(self, dp: ClientLevelDP, server_round: int) -> tuple[float, str | None]:
        """(ε after this round, refusal reason or None). Budget = ε(T) of the planned ``dp-rounds``."""
        budget = cached_epsilon(dp, None)
        eps_next = cached_epsilon(dp, server_round)
        if server_round > dp.rounds or eps_next > budget * (1 + EPS_SLACK):
            return eps_next, (f"budget: round {server_round} would spend client-level epsilon={eps_next:.4f} > "
                              f"budget {budget:.4f} planned for dp-rounds={dp.rounds}")
        return eps_next, None

    # ---- hooks -----------------------------------------------------------------------
    def local_steps(self) -> int:
        return local_steps(self.s.cfg, len(self.s.train), self.s.profile.batch_size)

    def local_train(self, model: nn.Module, *, lr: float, seed: int, config: dict[str, Any]) -> TrainResult:
        """*hook*: τ local steps in place on ``model`` (DP2-FedSAM overrides with SAM)."""
        return train_local_steps(model, self.s.train, batch_size=self.s.profile.batch_size, steps=self.local_steps(),
                                 lr=lr, momentum=float(self.s.cfg["momentum"]), device=self.s.device, seed=seed)

    def privatize(self, update: np.ndarray, shapes: list[tuple[int, ...]], config: dict[str, Any],
                  dp: ClientLevelDP | None, rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, Any]]:
        """*hook*: Δ (flat) → wire arrays + metrics. Dense per-layer arrays, or the k masked values."""
        sparsifier, indices = mask_from_config(config, update.size)
        clip = float(self.s.cfg["clip-norm"])
        if indices is None:
            noisy, norm = dp_dense(update, clip=clip, dp=dp, rng=rng)
            return unflatten(noisy, shapes), {"update_norm": norm, "k": update.size}
        values, norm = dp_spar(update, indices, sparsifier, clip=clip, dp=dp, rng=rng)
        return encode_sparse(values), {"update_norm": norm, "k": len(indices)}

    # ---- Flower API ------------------------------------------------------------------
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return get_weights(self.s.new_model())

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]):
        p, cfg = self.s.profile, self.s.cfg
        server_round = int(config["server-round"])
        metrics: dict[str, Any] = {"client_id": p.client_id, "batch_size": p.batch_size, "num_train": len(self.s.train)}
        dp = self.mechanism()
        if dp is not None:
            eps_next, reason = self.budget_check(dp, server_round)
            metrics.update({"noise_multiplier": dp.noise_multiplier, "sample_rate": dp.sample_rate, "delta": dp.delta,
                            "epsilon_budget": cached_epsilon(dp, None), "steps": server_round})
            if CFG_SIGMA in config and not math.isclose(float(config[CFG_SIGMA]), dp.noise_multiplier, rel_tol=1e-9):
                reason = (f"server asks for noise multiplier {config[CFG_SIGMA]} but this client's run-config "
                          f"gives {dp.noise_multiplier}")
            if reason is not None:
                metrics.update({"status": "refused", "reason": reason,
                                "epsilon_spent": cached_epsilon(dp, min(server_round - 1, dp.rounds))})
                return [], 0, metrics
            metrics["epsilon_spent"] = eps_next
        if p.batch_size > len(self.s.train):
            return [], 0, {**metrics, "status": "refused",
                           "reason": f"batch-size {p.batch_size} > local dataset size {len(self.s.train)}"}
        model = self.s.new_model()
        set_weights(model, parameters)
        lr = round_lr(cfg, server_round)
        result = self.local_train(model, lr=lr, seed=round_seed(cfg, p.client_id, server_round, stream=411),
                                  config=config)
        update = flatten(get_weights(model)) - flatten(parameters)
        rng = np.random.default_rng(noise_seed(cfg, p.client_id, server_round))  # secret unless seeded-noise
        try:
            arrays, extra = self.privatize(update, [tuple(a.shape) for a in parameters], config, dp, rng)
        except (KeyError, ValueError) as exc:  # malformed mask from the server: send nothing
            return [], 0, {**metrics, "status": "refused", "reason": f"bad round config from server: {exc}"}
        metrics.update({"status": "ok", "train_seconds": result.seconds, "lr": lr, "steps_round": result.steps, **extra})
        if dp is None:  # non-private baselines only: loss and pre-clip norm of private data are not covered by DP
            metrics["train_loss"] = result.loss
        else:
            metrics.pop("update_norm", None)
        return arrays, len(self.s.train), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]):
        return evaluate_on_local_test(self.s, parameters)


def make_client_dp_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """DP-FedAvg / Fed-SMP client (client-level DP)."""
    return ClientLevelDPClient(setup_client(context, overrides), context, private=True).to_client()


def make_compressed_client(context: Context, overrides: dict[str, Any] | None = None) -> Client:
    """FedAvg-randk / FedAvg-topk client (sparsified + clipped, no noise)."""
    return ClientLevelDPClient(setup_client(context, overrides), context, private=False).to_client()
