"""Shared client glue: resolving config/profile/data from a Flower ``Context``, seeds, state records."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.common import ConfigRecord, Context, log

from fedapp.clients.training import DEFAULT_GENERATOR, evaluate_model, resolve_device, set_weights
from fedapp.compat.runtime import on_supernode
from fedapp.config import DataConfig, GeneralConfig, TrainingConfig, resolve_config
from fedapp.config.run_config import record_canaries
from fedapp.data.canaries import with_canaries
from fedapp.data.client_data import load_client_data
from fedapp.data.datasets import ArrayDataset
from fedapp.data.node_data import NodeDataError, is_node_local, node_splits
from fedapp.models.catalog import ModelSpec
from fedapp.models.zoo import build_model
from fedapp.privacy.profiles import ClientProfile, client_profile


@dataclass
class ClientSetup:
    """What every client is built from, resolved from run-config and node-config: the general, data and training
    sections, the run's model, this client's profile, its splits and device. A family's own section (client-level
    DP, SoteriaFL, DP2-FedSAM) is a constructor argument of that family's client."""

    general: GeneralConfig
    data: DataConfig
    training: TrainingConfig
    model_spec: ModelSpec
    profile: ClientProfile
    train: ArrayDataset
    test: ArrayDataset
    device: torch.device
    validation: ArrayDataset | None = None  # ``validation-fraction`` of the training part, for tuning only

    @property
    def dp_rounds(self) -> int:
        """T of the budget: ``dp-rounds``, 0 → ``num-server-rounds``."""
        return self.training.dp_rounds or self.general.num_server_rounds

    def new_model(self) -> torch.nn.Module:
        return make_model(self.model_spec, self.train)


def evaluate_on_local_test(setup: ClientSetup, parameters: list) -> tuple[float, int, dict[str, Any]]:
    """Federated evaluation: the global model on this client's local test split (``NumPyClient.evaluate``)."""
    model = setup.new_model()
    set_weights(model, parameters)
    return evaluate_local_splits(setup, model)


def evaluate_local_splits(setup: ClientSetup, model: torch.nn.Module) -> tuple[float, int, dict[str, Any]]:
    """(loss, n, metrics) of ``model`` on the local test split; ``val_loss``/``val_accuracy`` on the local
    validation split when there is one (what ``fedapp.experiments.report`` tunes on; the test split is what it reports)."""
    metrics: dict[str, Any] = {"client_id": setup.profile.client_id}
    batch = int(setup.general.eval_batch_size)
    if setup.validation is not None and len(setup.validation) > 0:
        val_loss, val_acc = evaluate_model(model, setup.validation, batch_size=batch, device=setup.device)
        metrics.update({"val_loss": float(val_loss), "val_accuracy": float(val_acc)})
    if len(setup.test) == 0:
        return 0.0, 0, metrics
    loss, acc = evaluate_model(model, setup.test, batch_size=batch, device=setup.device)
    return float(loss), len(setup.test), {**metrics, "accuracy": float(acc)}


def make_model(spec: ModelSpec, data: ArrayDataset) -> torch.nn.Module:
    """The run's model for ``data``'s shapes, initialized from the spec's seed (identical on server and every client)."""
    return model_for_shape(spec, data.input_shape, data.num_classes)


def model_for_shape(spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """The run's model for inputs of ``input_shape`` and ``num_classes`` classes, initialized from the spec's seed."""
    with DEFAULT_GENERATOR:  # one seeded build at a time (ClientApps on threads)
        torch.manual_seed(spec.seed)
        return build_model(spec.name, tuple(input_shape), int(num_classes), nonconvex_lambda=spec.nonconvex_lambda)


def setup_client(context: Context, overrides: dict[str, Any] | None = None) -> ClientSetup:
    """This node's setup. With ``dataset = 'node-local'`` its splits come from its own ``data-path``
    (:func:`fedapp.data.node_data.node_splits`), and a data problem raises :class:`~fedapp.data.node_data.NodeDataError`,
    which the ClientApp answers with a refusal."""
    cfg = resolve_config(context.run_config, overrides)
    profile = client_profile(cfg.general, cfg.training, cfg.data, context.node_config)
    if is_node_local(cfg.data):
        train, validation, test = node_splits(context.node_config, cfg.data, cfg.general.seed, profile.client_id)
        profile = node_batch(profile, cfg.training, context.node_config, len(train))
        log(INFO, "client %d trains on its own data-path %s: %d train, %d validation, %d local test examples (this "
            "line stays on the node)", profile.client_id, context.node_config["data-path"], len(train),
            len(validation), len(test))
    else:
        train, validation, test = load_client_data(cfg.data, cfg.general.seed, profile.client_id, profile.num_clients)
        canaries = record_canaries(cfg.general)
        if canaries:  # a record-level audit (fedapp.privacy.record_audit): this client's canary records
            if on_supernode():
                raise NodeDataError(f"run-config 'audit-canaries' = {canaries} adds canary records to the clients' "
                                    "data; canaries belong in a simulation, and this is a SuperNode")
            train = with_canaries(train, cfg.general.audit_seed, canaries, profile.client_id, profile.num_clients)
    return ClientSetup(cfg.general, cfg.data, cfg.training, cfg.model_spec, profile, train, test,
                       resolve_device(cfg.general.device), validation)


def node_batch(profile: ClientProfile, training: TrainingConfig, node_config: Mapping[str, Any],
               num_train: int) -> ClientProfile:
    """A node-local profile's batch size against its N_i: a drawn b_i is capped at N_i (as a partition's is); one the
    run-config or node-config sets above N_i is a :class:`~fedapp.data.node_data.NodeDataError` naming the key."""
    if profile.batch_size <= num_train:
        return profile
    if "batch-size" in node_config or training.batch_size > 0:
        key = "node-config 'batch-size'" if "batch-size" in node_config else "run-config 'batch-size'"
        raise NodeDataError(f"{key} = {profile.batch_size} exceeds this node's N_i = {num_train} training examples "
                            "(node-config 'data-path' after its local test and validation splits)")
    return dataclasses.replace(profile, batch_size=num_train)


def round_seed(seed: int, client_id: int, server_round: int, stream: int = 401) -> int:
    """Independent, reproducible seed per (run seed, client, round)."""
    return int(np.random.SeedSequence([seed, stream, client_id, server_round]).generate_state(1)[0])


def noise_seed(general: GeneralConfig, client_id: int, server_round: int) -> int:
    """Seed of a client's DP randomness (noise, Poisson sampling).

    Secret by default (OS entropy): the server knows the run seed, so noise derived from it
    could be regenerated and subtracted. ``seeded-noise = true`` makes it reproducible from the
    run seed, for tests and benchmarks only.
    """
    if general.seeded_noise:
        return round_seed(general.seed, client_id, server_round, stream=402)
    return secrets.randbits(63)


def secure_randomness(general: GeneralConfig, node_config: Mapping[str, Any] | None = None) -> bool:
    """Whether this client draws its DP randomness from a CSPRNG: run-config ``secure-randomness``, or node-config
    ``secure-randomness = true`` (a node's own policy: the server cannot turn it off)."""
    from fedapp.privacy.node_policy import node_bool

    return general.secure_randomness or node_bool(node_config or {}, "secure-randomness", False)


def noise_rng(general: GeneralConfig, client_id: int, server_round: int,
              node_config: Mapping[str, Any] | None = None) -> np.random.Generator:
    """The generator of a client's DP noise and sampling coins for one round.

    Default: NumPy's PCG64 seeded with 63 bits of OS entropy (:func:`noise_seed`): statistically sound, not a
    cryptographic generator (its state can be recovered from enough outputs). Under :func:`secure_randomness`:
    ChaCha20 (20 rounds, ``randomgen``) keyed with 256 bits from ``secrets``, a CSPRNG. ``seeded-noise`` (tests and
    benchmarks) derives PCG64 from the run seed."""
    if secure_randomness(general, node_config) and not general.seeded_noise:
        return csprng()
    return np.random.default_rng(noise_seed(general, client_id, server_round))


def csprng() -> np.random.Generator:
    """A NumPy ``Generator`` over ChaCha20 (20 rounds) keyed with 256 bits of OS entropy."""
    from randomgen import ChaCha

    return np.random.Generator(ChaCha(key=secrets.randbits(256), counter=0, rounds=20))


def round_lr(lr: float, decay: float, server_round: int) -> float:
    """η_r = η · decay^(r−1) (per-round decay, e.g. Fed-SMP Sec. 6.2, DP2-FedSAM Sec. 5.1)."""
    return lr * decay ** (server_round - 1)


def read_record(context: Context, name: str) -> dict[str, Any]:
    return dict(context.state[name]) if name in context.state else {}


def write_record(context: Context, name: str, values: dict[str, Any]) -> None:
    context.state[name] = ConfigRecord(values)


def restart_if_diverged(delta: np.ndarray, client_id: int, server_round: int) -> tuple[np.ndarray, bool]:
    """Client-level DP: (Δ, False) when local training left a finite update, else (0, True).

    A diverged client restarts the round from the global model, so its contribution is the clipped zero
    vector plus its full noise share: the secure sum stays valid and carries its planned noise, and no
    NaN ever reaches clipping or SecAgg+'s quantizer. Whether training diverged depends on the client's
    data before any noise is added, so it is logged here and never sent to the server.
    """
    if np.all(np.isfinite(delta)):
        return delta, False
    log(WARNING, "client %d, round %d: local training diverged (%d non-finite coordinates); this round restarts "
        "from the global model (a zero update plus the mechanism's noise)", client_id, server_round,
        int(np.sum(~np.isfinite(delta))))
    return np.zeros_like(delta), True


def nonfinite_model_refusal(parameters: list[np.ndarray]) -> str | None:
    """Why a client does not train on the server's model: an array with NaN, ±inf or a value beyond float32's range
    (what the model holds; a finite float64 of 10^39 would load as inf). None when every array is finite. The check
    reads only the server's model, so the refusal reveals nothing about the client's data."""
    f32_max = float(np.finfo(np.float32).max)
    for i, w in enumerate(parameters):
        a = np.asarray(w)
        if a.dtype.kind != "f" or a.size == 0:
            continue
        if not np.all(np.isfinite(a)) or (a.dtype.itemsize > 4 and float(np.max(np.abs(a))) > f32_max):
            return (f"the server's model is not finite (array {i} of {len(parameters)} holds NaN, inf or a value "
                    "beyond float32's range); this client does not train on it")
    return None
