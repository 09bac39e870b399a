"""Heterogeneous record-level DP-SGD client (Robust-HDP Sec. 3; Noble et al. DPFedAvg).

Protects every *record* of the client's local dataset against anyone who sees its updates
(the server included): local, record-level (ε_i, δ_i)-DP over all rounds.

Before its first round a client calibrates its noise multiplier z_i with the accountant so
that ``dp-rounds`` rounds of K_i·⌈N_i/b_i⌉ DP-SGD steps spend exactly ε_i (to 0.1 %). The
neighbouring relation is run-config ``record-neighbours``: replace-one by default (the client
releases N_i, which tells add/remove neighbours apart), composed by dp_accounting's PLD
accountant; add-remove composes with ``accountant`` (Opacus). The reply declares the relation
(``record_neighbours``) so the server's ledger composes the same. The accountant history lives
in Flower ``Context.state`` so each reported ε is cumulative and exact. A round that would push
ε above ε_i is refused: the client does not train and replies ``status = "refused"`` with the
reason; so is every round when δ_i > 1/(10·N_i) (node-config or run-config ``delta``) unless
``allow-large-delta`` — checked here, so a deployed SuperNode's node-config δ is covered.
A server model that is not finite is refused before training; a round whose DP-SGD still ends non-finite sends
its noise-only steps instead (:meth:`DPSGDClient.noise_only_update`), a reply of the same form.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import Context, log

from fedapp.clients.broken_mechanism import noise_scale_fault
from fedapp.clients.common import (
    ClientSetup,
    evaluate_on_local_test,
    noise_seed,
    nonfinite_model_refusal,
    read_record,
    round_lr,
    round_seed,
    write_record,
)
from fedapp.clients.grad_sample_mode import resolve_grad_sample_mode
from fedapp.clients.training import (
    LocalTraining,
    PerSampleDP,
    get_weights,
    local_train,
    set_weights,
)
from fedapp.privacy.profiles import dpsgd_sample_rate, steps_per_epoch
from fedapp.state.cache import calibrated_noise_multiplier
from strategies.privacy.accountants import compact_history, epsilon_of, record_accountant
from strategies.privacy.budget import budget_refusal
from strategies.privacy.mechanisms import max_delta

STATE_KEY = "dpsgd-accountant"


class DPSGDClient(NumPyClient):
    """Runs DP-SGD (``private=True``) or plain SGD (``private=False``) and returns Δ = θ_local − θ."""

    #: the batch loss of local training (None: cross-entropy; see ``LocalTraining.loss``)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, setup: ClientSetup, context: Context, private: bool = True) -> None:
        self.s = setup
        self.context = context
        self.private = private

    # ---- privacy state -------------------------------------------------------------
    @property
    def num_train(self) -> int:
        return len(self.s.train)

    def sample_rate(self) -> float:
        return dpsgd_sample_rate(self.num_train, self.s.profile.batch_size)

    def steps_per_round(self) -> int:
        return self.s.profile.local_epochs * steps_per_epoch(self.num_train, self.s.profile.batch_size)

    def load_history(self) -> tuple[float | None, list[tuple[float, float, int]]]:
        rec = read_record(self.context, STATE_KEY)
        z = rec.get("noise_multiplier")
        hist = list(zip(rec.get("hist_z", []), rec.get("hist_q", []), rec.get("hist_steps", [])))
        return (float(z) if z is not None else None), compact_history(hist)

    def save_history(self, z: float, history: list[tuple[float, float, int]], rounds: int) -> None:
        hist = compact_history(history)
        write_record(self.context, STATE_KEY, {
            "noise_multiplier": float(z), "rounds": int(rounds),
            "hist_z": [h[0] for h in hist], "hist_q": [h[1] for h in hist], "hist_steps": [int(h[2]) for h in hist],
        })

    def noise_multiplier(self) -> float:
        z, hist = self.load_history()
        if z is None:
            z = self.calibrate()
            self.save_history(z, hist, 0)
        return z

    def accountant(self) -> str:
        """The accountant of this client's ε: run-config ``accountant`` under ``record-neighbours``."""
        return record_accountant(self.s.training.accountant, self.s.training.record_neighbours)

    def calibrate(self) -> float:
        """z_i such that ``dp-rounds`` rounds of this client's DP-SGD spend ε_i (shared-cache aware)."""
        p = self.s.profile
        return calibrated_noise_multiplier(p.epsilon, p.delta, self.sample_rate(),
                                           self.s.dp_rounds * self.steps_per_round(), self.accountant())

    def grad_sample_mode(self) -> str:
        if self.s.training.cuda_graphs:  # the graphs capture hooks steps (run-config checks hooks or auto)
            if self.s.device.type != "cuda":
                raise RuntimeError(f"run-config 'cuda-graphs' = true, but this client trains on {self.s.device} "
                                   "(device = 'auto' found no CUDA device here); set cuda-graphs = false")
            return "hooks"
        return resolve_grad_sample_mode(self.s.training.grad_sample_mode, self.s.model_spec.name, self.s.new_model,
                                        self.s.train, self.s.profile.batch_size, self.s.device)

    # ---- Flower API ------------------------------------------------------------------
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return get_weights(self.s.new_model())

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]):
        p, training = self.s.profile, self.s.training
        server_round = int(config["server-round"])
        metrics: dict[str, Any] = {
            "client_id": p.client_id, "batch_size": p.batch_size, "local_epochs": p.local_epochs,
            "num_train": self.num_train,
        }
        if p.batch_size > self.num_train:
            return [], 0, {**metrics, "status": "refused",
                           "reason": f"batch-size {p.batch_size} > local dataset size {self.num_train}"}
        reason = nonfinite_model_refusal(parameters)
        if reason is not None:
            return [], 0, {**metrics, "status": "refused", "reason": reason}
        model = self.s.new_model()
        set_weights(model, parameters)
        lr = round_lr(training.lr, training.lr_decay, server_round)
        seed = round_seed(self.s.general.seed, p.client_id, server_round)  # plain SGD shuffling: no secret needed
        if self.private:
            reason = record_delta_refusal(p.delta, self.num_train, self.context.node_config,
                                          training.allow_large_delta)
            if reason is not None:
                return [], 0, {**metrics, "status": "refused", "reason": reason}
            seed = noise_seed(self.s.general, p.client_id, server_round)  # DP noise + Poisson sampling: secret
            z = self.noise_multiplier()
            _, hist = self.load_history()
            rounds_done = int(read_record(self.context, STATE_KEY).get("rounds", 0))
            q, steps, kind = self.sample_rate(), self.steps_per_round(), self.accountant()
            eps_now = epsilon_of(hist, p.delta, kind)
            eps_next = epsilon_of(hist + [(z, q, steps)], p.delta, kind)
            metrics.update({"noise_multiplier": z, "sample_rate": q, "epsilon_budget": p.epsilon, "delta": p.delta,
                            "reported_epsilon": p.reported_epsilon, "steps": sum(h[2] for h in hist),
                            "record_neighbours": training.record_neighbours})
            reason = budget_refusal(server_round, eps_next, p.epsilon, f"spent {eps_now:.4f} in {rounds_done} rounds")
            if reason is not None:
                metrics.update({"status": "refused", "epsilon_spent": eps_now, "reason": reason})
                return [], 0, metrics
            spec = LocalTraining(batch_size=p.batch_size, steps=steps, lr=lr, momentum=training.momentum,
                                 seed=seed, dp=PerSampleDP(z * noise_scale_fault(), training.clip_norm,  # 1 unless a test
                                                 self.grad_sample_mode(), training.cuda_graphs),
                                 loss=self.loss)
            result = local_train(model, self.s.train, spec, self.s.device)
            if not math.isclose(result.extra["sample_rate"], q) or result.steps != steps:
                raise RuntimeError(f"DP-SGD ran q={result.extra['sample_rate']}, {result.steps} steps; "
                                   f"accountant expected q={q}, {steps} steps")
            hist = hist + [(z, q, steps)]
            self.save_history(z, hist, rounds_done + 1)
            metrics.update({"epsilon_spent": epsilon_of(hist, p.delta, kind),
                            "steps": sum(h[2] for h in hist)})
        else:
            spec = LocalTraining(batch_size=p.batch_size, steps=self.steps_per_round(), lr=lr,
                                 momentum=training.momentum, seed=seed, loss=self.loss)
            result = local_train(model, self.s.train, spec, self.s.device)
            metrics["steps"] = result.steps
        update = [new - old for new, old in zip(get_weights(model), parameters)]
        seconds = result.seconds
        if self.private and not all(np.all(np.isfinite(u)) for u in update):
            update, extra_seconds = self.noise_only_update(parameters, spec, server_round)
            seconds += extra_seconds
        metrics.update({"status": "ok", "train_seconds": seconds, "lr": lr, "steps_round": result.steps})
        if not all(np.all(np.isfinite(u)) for u in update):
            # plain SGD (no DP to keep), or DP-SGD's noise-only steps from the server's model: data-independent
            metrics.update({"status": "failed", "reason": "local training diverged (non-finite model)"})
            return [], self.num_train, metrics
        if not self.private:  # a loss on private records is not covered by the DP guarantee: never sent by DP clients
            metrics["train_loss"] = result.loss
        return update, self.num_train, metrics

    def noise_only_update(self, parameters: list[np.ndarray], spec: LocalTraining,
                          server_round: int) -> tuple[list[np.ndarray], float]:
        """(Δ, seconds) of the round's DP-SGD steps from the server's model with every per-sample gradient clipped to
        0: each step is the mechanism's noise N(0, c²z²) alone, at the same q, steps, η and momentum, from fresh
        secret randomness. Sent in place of a trained model that is not finite: replacing DP-SGD's output by a draw
        independent of the data is post-processing, and the reply has the form of any other. That training
        diverged is logged here, never sent."""
        assert spec.dp is not None
        log(WARNING, "client %d, round %d: DP-SGD left a non-finite model; this round sends its noise-only steps from "
            "the server's model", self.s.profile.client_id, server_round)
        model = self.s.new_model()
        set_weights(model, parameters)
        fallback = dataclasses.replace(
            spec, seed=noise_seed(self.s.general, self.s.profile.client_id, server_round),
            dp=dataclasses.replace(spec.dp, noise_only=True, cuda_graphs=False))
        result = local_train(model, self.s.train, fallback, self.s.device)
        return [new - old for new, old in zip(get_weights(model), parameters)], result.seconds

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]):
        return evaluate_on_local_test(self.s, parameters)


def record_delta_refusal(delta: float, num_records: int, node_config: Mapping[str, Any],
                         allow_large_delta: bool) -> str | None:
    """Why a record-level client with δ_i = ``delta`` over N_i = ``num_records`` records may not train: δ_i above
    1/(10·N_i) without run-config ``allow-large-delta`` (None when it may). Checked by the client itself, so a
    deployed SuperNode's node-config δ is covered as well as a simulation's run-config δ."""
    if allow_large_delta or num_records < 1 or delta <= max_delta(num_records):
        return None
    source = "node-config 'delta'" if "delta" in node_config else "run-config 'delta'"
    return (f"{source} = {delta:g} is above 1/(10 N_i) = {max_delta(num_records):.3g} for this client's N_i = "
            f"{num_records} records; set run-config 'allow-large-delta' = true to train with it anyway")


def min_epsilon_profile(setup: ClientSetup) -> ClientSetup:
    """The same client training at the federation's minimum ε (Robust-HDP's "minimum ε" baseline).

    In simulation every profile is a function of the run-config, so the minimum is
    min_j ε_j over ``federation_profiles`` (and this node's own ε, which a node-config may
    lower). In deployment every node must be given the agreed minimum as node-config
    ``epsilon``. The client reports the ε it trains with, unless its report is falsified.
    """
    from fedapp.privacy.profiles import federation_profiles

    p = setup.profile
    eps_min = min([q.epsilon for q in federation_profiles(setup.general, setup.training, setup.data, p.num_clients)]
                  + [p.epsilon])
    reported = eps_min if p.reported_epsilon == p.epsilon else p.reported_epsilon
    return dataclasses.replace(setup, profile=dataclasses.replace(p, epsilon=eps_min, reported_epsilon=reported))
