"""SoteriaFL-family client (``strategies/soteriafl.py``): one round = one step of Algorithm 2/3.

Protects every record of the client's local data against the (untrusted) server and anyone
who sees its messages: record-level local (ε_i, δ_i)-DP over ``dp-rounds`` rounds. Per-sample
gradients are clipped to G = ``clip-norm``, Gaussian noise N(0, σ_p² I) is added on the client,
and only the noisy estimator is (shift-)compressed. σ_p is calibrated once with the accountant
(:func:`strategies.soteriafl.calibrate_sigma`, through the per-machine cache
:func:`fedapp.state.cache.calibrated_soteriafl_sigma`) under run-config ``record-neighbours`` (replace-one by
default, dp_accounting's PLD: the client releases m = N_i; add-remove: ``accountant``), which the reply
declares (``record_neighbours``) for the server's ledger; a round that would exceed ε_i is refused
(``status = "refused"``), and so is every round when δ_i > 1/(10·m) unless ``allow-large-delta``.

Persistent client state lives in Flower ``Context.state``: the shift s_i, the SVRG snapshot w
and its full clipped gradient, the SAGA table (``ArrayRecord`` "soteriafl-arrays") and the
privacy ledger (``ConfigRecord`` "soteriafl-privacy"). The reply is one float32 array — the k
random-k values (or d dense values for the uncompressed baselines) — plus the mask seed in the
metrics.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from flwr.client import NumPyClient
from flwr.common import Array, ArrayRecord, Context

from fedapp.clients.common import (
    ClientSetup,
    evaluate_on_local_test,
    noise_rng,
    nonfinite_model_refusal,
    read_record,
    write_record,
)
from fedapp.clients.dpsgd import record_delta_refusal
from fedapp.clients.training import get_weights, set_weights
from fedapp.config import ConfigError, SoteriaFLConfig
from fedapp.state.cache import calibrated_soteriafl_sigma
from strategies.compression import rand_k_omega
from strategies.privacy.accountants import epsilon_of, record_accountant
from strategies.privacy.budget import budget_refusal
from strategies.soteriafl import (
    ClientState,
    GradientOracle,
    client_step,
    default_batch_size,
    default_k,
    get_method,
    mask_seed,
    noise_history,
    payload_bits,
    shift_stepsize,
    snapshot_coin,
    theorem2_sigma,
)

PRIVACY_KEY = "soteriafl-privacy"
ARRAYS_KEY = "soteriafl-arrays"


def soteriafl_params(options: SoteriaFLConfig, d: int) -> tuple[int, float, float]:
    """(k, ω, γ) for a model of dimension d: k = ``soteriafl-k`` (0 → d/20), γ = ``soteriafl-gamma``
    (0 → Theorem 3's value for ω = d/k − 1)."""
    k = options.soteriafl_k or default_k(d)
    if k > d:
        raise ConfigError(f"run-config 'soteriafl-k' = {k} exceeds the model dimension d = {d}")
    omega = rand_k_omega(d, k)
    gamma = options.soteriafl_gamma or shift_stepsize(omega)
    return k, omega, gamma


def load_state(context: Context) -> ClientState:
    st = ClientState()
    if ARRAYS_KEY in context.state:
        rec = context.state.array_records[ARRAYS_KEY]
        for key in rec.keys():
            setattr(st, key, np.array(rec[key].numpy()))
    st.rounds = int(read_record(context, PRIVACY_KEY).get("rounds", 0))
    return st


def save_state(context: Context, st: ClientState) -> None:
    context.state[ARRAYS_KEY] = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in st.arrays().items()})


class SoteriaFLClient(NumPyClient):
    """Gradient estimator + local DP noise + (shifted) random-k compression of one client."""

    def __init__(self, setup: ClientSetup, soteriafl: SoteriaFLConfig, context: Context) -> None:
        self.s = setup
        self.soteriafl = soteriafl  # the run-config's SoteriaFL section
        self.context = context
        self.method = get_method(setup.general.strategy)

    # ---- parameters of this client -------------------------------------------------------
    @property
    def m(self) -> int:
        return len(self.s.train)

    def dims(self) -> tuple[int, int, float, float]:
        d = int(sum(w.size for w in get_weights(self.s.new_model())))
        k, omega, gamma = soteriafl_params(self.soteriafl, d)
        return d, k, omega, gamma

    def batch_size(self, d: int, omega: float) -> int:
        b = int(self.soteriafl.soteriafl_batch_size)
        if b:
            return b
        p = self.s.profile
        return default_batch_size(self.method.estimator, self.m, epsilon=p.epsilon, delta=p.delta,
                                  clip=float(self.s.training.clip_norm), d=d, omega=omega, n=p.num_clients)

    def accountant(self) -> str:
        """The accountant of this client's ε: run-config ``accountant`` under ``record-neighbours``."""
        return record_accountant(self.s.training.accountant, self.s.training.record_neighbours)

    def privacy(self, b: int) -> dict[str, Any]:
        """The privacy ledger; σ_p is calibrated on first use for ``dp-rounds`` rounds."""
        rec = read_record(self.context, PRIVACY_KEY)
        if "sigma_p" not in rec:
            p, training = self.s.profile, self.s.training
            sigma, split = calibrated_soteriafl_sigma(self.method.estimator, p.epsilon, p.delta,
                                                      training.clip_norm, b, self.m, self.s.dp_rounds,
                                                      self.accountant())
            rec = {"sigma_p": sigma, "split": split, "batch_size": b, "rounds": 0,
                   "sigma_theorem2": theorem2_sigma(self.method.estimator, p.epsilon, p.delta,
                                                    training.clip_norm, self.m, self.s.dp_rounds)}
            write_record(self.context, PRIVACY_KEY, rec)
        return rec

    def epsilon_after(self, rec: dict[str, Any], rounds: int) -> float:
        if rounds <= 0:
            return 0.0
        hist = noise_history(self.method.estimator, float(rec["sigma_p"]), float(self.s.training.clip_norm),
                             int(rec["batch_size"]), self.m, rounds, float(rec["split"]))
        return epsilon_of(hist, self.s.profile.delta, self.accountant())

    # ---- Flower API ----------------------------------------------------------------------
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return get_weights(self.s.new_model())

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]):
        t0 = time.perf_counter()
        p, training = self.s.profile, self.s.training
        server_round = int(config["server-round"])
        metrics: dict[str, Any] = {"client_id": p.client_id, "num_train": self.m}
        if str(config.get("soteriafl-method", self.method.name)) != self.method.name:
            return [], 0, {**metrics, "status": "refused",
                           "reason": f"server runs {config.get('soteriafl-method')!r}, client {self.method.name!r}"}
        reason = record_delta_refusal(p.delta, self.m, self.context.node_config,
                                      training.allow_large_delta) or nonfinite_model_refusal(parameters)
        if reason is not None:
            return [], 0, {**metrics, "status": "refused", "reason": reason}
        d, k, omega, gamma = self.dims()
        b = self.batch_size(d, omega)
        if not 1 <= b <= self.m:
            return [], 0, {**metrics, "status": "refused",
                           "reason": f"soteriafl batch size {b} not in 1..m={self.m}"}
        rec = self.privacy(b)
        done = int(rec["rounds"])
        q = 1.0 if self.method.estimator == "gd" else b / self.m
        metrics.update({"batch_size": b, "sample_rate": q, "epsilon_budget": p.epsilon, "delta": p.delta,
                        "reported_epsilon": p.reported_epsilon, "steps": done, "sigma_p": float(rec["sigma_p"]),
                        "sigma_theorem2": float(rec["sigma_theorem2"]), "noise_split": float(rec["split"]),
                        "record_neighbours": training.record_neighbours,
                        # z of the (subsampled) minibatch term; SVRG/SAGA also have z₂ of the full-data term
                        "noise_multiplier": noise_history(self.method.estimator, float(rec["sigma_p"]),
                                                          training.clip_norm, b, self.m, 1,
                                                          float(rec["split"]))[0][0]})
        eps_now, eps_next = self.epsilon_after(rec, done), self.epsilon_after(rec, done + 1)
        reason = budget_refusal(server_round, eps_next, p.epsilon, f"spent {eps_now:.4f} in {done} rounds")
        if reason is not None:
            return [], 0, {**metrics, "status": "refused", "epsilon_spent": eps_now, "reason": reason}
        x = np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in parameters])
        model = self.s.new_model()
        set_weights(model, parameters)
        oracle = GradientOracle(model, self.s.train.x, self.s.train.y, self.s.device)
        state = load_state(self.context)
        rseed = int(config["round-seed"])
        p_snap = self.soteriafl.soteriafl_snapshot_prob or b / self.m
        seed = mask_seed(rseed, p.client_id)
        res = client_step(self.method, oracle, x, state, clip=training.clip_norm, batch_size=b,
                          sigma_p=float(rec["sigma_p"]), k=k, gamma=gamma,
                          rng=noise_rng(self.s.general, p.client_id, server_round, self.context.node_config),  # secret
                          seed=seed, refresh_snapshot=snapshot_coin(rseed, p.client_id, p_snap))
        save_state(self.context, state)
        write_record(self.context, PRIVACY_KEY, {**rec, "rounds": done + 1})
        metrics.update({"status": "ok", "epsilon_spent": eps_next, "steps": done + 1,
                        "payload_bits": payload_bits(self.method, len(res.values)),
                        "train_seconds": time.perf_counter() - t0})
        # The realized Poisson batch size (and the gradient count derived from it) is not sent: its law
        # depends on whether a record is in the dataset, so it would leak outside the accounted mechanism.
        if self.method.compression != "none":
            metrics["mask_seed"] = seed
        return [res.values], self.m, metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]):
        return evaluate_on_local_test(self.s, parameters)
