"""The project's DP clients around a user's own model, data and loss, for a user's own ClientApp.

* :func:`dpsgd_client`: record-level DP-SGD (Opacus) with this client's (ε, δ) budget: the client of
  :func:`fedapp.library.server.robust_hdp` and :func:`~fedapp.library.server.dpsgd_fedavg` (``private=False``: plain
  SGD, for :func:`~fedapp.library.server.fedavg`). It is :class:`fedapp.clients.dpsgd.DPSGDClient`, unchanged: noise
  calibrated by the accountant to spend ε over ``DPSGDSettings.rounds`` rounds, Poisson batches, the accountant's
  history in Flower's ``Context.state``, refusal of a round that would exceed ε or of δ above 1/(10 N).
* :func:`client_level_client`: client-level clip-and-noise (:class:`fedapp.clients.client_dp.ClientLevelDPClient`,
  dense, without SecAgg+): the client of :func:`~fedapp.library.server.dp_fedavg`.

Both are built from a :class:`~fedapp.clients.common.ClientSetup` made from the user's objects instead of the
run-config; the node guard of the project's ClientApp (node-config privacy policy, lifetime budgets across runs, the
lost-accountant check, fault injection) is not applied.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.client import Client
from flwr.common import Context
from torch import nn

from fedapp.clients.client_dp import ClientLevelDPClient
from fedapp.clients.common import ClientSetup
from fedapp.clients.dpsgd import DPSGDClient
from fedapp.clients.training import LocalTraining, TrainResult, local_train, resolve_device, set_weights
from fedapp.config import ClientDPConfig, DataConfig, GeneralConfig, TrainingConfig
from fedapp.data.datasets import ArrayDataset
from fedapp.library.data import UserData, as_array_dataset, loader_batch_size
from fedapp.library.evaluation import Loss, check_model, evaluate_user_model
from fedapp.library.settings import DPSGDSettings
from fedapp.models.catalog import ModelSpec
from fedapp.privacy.profiles import ClientProfile
from strategies.privacy.mechanisms import ClientLevelDP


@dataclass
class UserSetup(ClientSetup):
    """A :class:`ClientSetup` whose model is a copy of the user's module (not a catalog model), with the user's loss."""

    template: nn.Module | None = None
    loss: Loss | None = None

    def new_model(self) -> nn.Module:
        if self.template is None:
            raise RuntimeError("UserSetup needs the user's model (template)")
        return copy.deepcopy(self.template)


def _setup(model: nn.Module, train: UserData, test: UserData | None, context: Context, *, training: TrainingConfig,
           batch_size: int | None, loss: Loss | None, client_id: int | None, device: str, seed: int,
           rounds: int, epsilon: float, delta: float, per_sample: bool) -> UserSetup:
    train_set = as_array_dataset(train, "train")
    test_set = as_array_dataset(test, "test", train_set.num_classes) if test is not None else \
        ArrayDataset(train_set.x[:0], train_set.y[:0], train_set.num_classes)
    check_model(model, train_set, loss, per_sample=per_sample)
    b = batch_size if batch_size is not None else loader_batch_size(train)
    if b is None or b < 1:
        raise ValueError(f"batch_size = {b!r}: pass batch_size >= 1, or train as a DataLoader with a batch size")
    if b > len(train_set):
        raise ValueError(f"batch_size = {b} exceeds the {len(train_set)} training records of this client")
    node = context.node_config
    cid = client_id if client_id is not None else node.get("partition-id")
    if cid is None:
        raise ValueError("client_id is needed where the node-config has no 'partition-id' (a deployed SuperNode)")
    num_clients = int(node.get("num-partitions", 0))
    profile = ClientProfile(int(cid), num_clients, float(epsilon), float(delta), int(b), training.local_epochs,
                            float(epsilon))
    general = GeneralConfig(num_server_rounds=rounds, seed=seed)
    training = dataclasses.replace(training, batch_size=int(b))
    spec = ModelSpec(f"user:{type(model).__module__}.{type(model).__qualname__}", seed)
    return UserSetup(general, DataConfig(), training, spec, profile, train_set, test_set, resolve_device(device),
                     template=copy.deepcopy(model), loss=loss)


def _evaluate(setup: UserSetup, parameters: list[np.ndarray]) -> tuple[float, int, dict[str, Any]]:
    """(loss, n, metrics) of the global model on this client's own test data, with the user's loss."""
    metrics: dict[str, Any] = {"client_id": setup.profile.client_id}
    if len(setup.test) == 0:
        return 0.0, 0, metrics
    model = setup.new_model()
    set_weights(model, parameters)
    loss, accuracy = evaluate_user_model(model, setup.test, setup.loss, setup.general.eval_batch_size, setup.device)
    if accuracy is not None:
        metrics["accuracy"] = accuracy
    return loss, len(setup.test), metrics


class UserDPSGDClient(DPSGDClient):
    """:class:`DPSGDClient` training with the user's loss and evaluating with it."""

    def __init__(self, setup: UserSetup, context: Context, private: bool = True) -> None:
        super().__init__(setup, context, private)
        self.loss = setup.loss

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        assert isinstance(self.s, UserSetup)
        return _evaluate(self.s, parameters)


def dpsgd_client(model: nn.Module, train: UserData, test: UserData | None = None, *, context: Context,
                 settings: DPSGDSettings, epsilon: float, delta: float, batch_size: int | None = None,
                 loss: Loss | None = None, client_id: int | None = None, private: bool = True,
                 allow_large_delta: bool = False, device: str = "cpu", seed: int = 0) -> Client:
    """A Flower ``Client`` running record-level DP-SGD on ``model`` over ``train`` with budget (``epsilon``,
    ``delta``) for ``settings.rounds`` rounds.

    ``train`` / ``test``: a ``DataLoader`` (its dataset and batch size are used; batches are Poisson-sampled at
    q = 1/⌈N/b⌉, never the loader's), a map-style ``Dataset`` of (x, y) items, or (x, y) arrays. ``loss``: the batch
    mean of per-sample losses (None: cross-entropy on class scores). ``client_id``: default the node-config's
    ``partition-id`` (set by the simulation); it must be unique in the federation. ``context``: the ClientApp's
    ``Context``, whose ``state`` keeps the accountant's history between rounds. ``seed`` seeds only plain SGD's
    shuffling; DP noise and Poisson sampling always come from OS entropy.

    Guarantee: every record of ``train`` is (ε, δ)-DP against anyone who sees this client's updates, the server
    included, over the ``settings.rounds`` rounds (neighbours: ``settings.record_neighbours``). ``test`` is read only
    by ``evaluate``, whose loss and accuracy go to the server unprotected, as in the project's own clients.

    Raises ``ValueError`` (:class:`~fedapp.library.evaluation.ModelProblem`,
    :class:`~fedapp.library.data.DataProblem`) for a model Opacus cannot train, a loss that is not a batch mean, a
    forward pass that fails on the data, or unreadable data; nothing is changed for you."""
    training = TrainingConfig(
        privacy_dist="fixed", epsilon=float(epsilon), delta=float(delta), allow_large_delta=allow_large_delta,
        local_epochs=settings.local_epochs, clip_norm=settings.clip_norm, dp_rounds=settings.rounds,
        accountant=settings.accountant, record_neighbours=settings.record_neighbours, grad_sample_mode="hooks",
        lr=settings.lr, momentum=settings.momentum, lr_decay=settings.lr_decay)
    if not (epsilon > 0 and np.isfinite(epsilon)) or not 0 < delta < 1:
        raise ValueError(f"epsilon = {epsilon} must be a finite number > 0 and delta = {delta} in (0, 1)")
    setup = _setup(model, train, test, context, training=training, batch_size=batch_size, loss=loss,
                   client_id=client_id, device=device, seed=seed, rounds=settings.rounds, epsilon=epsilon,
                   delta=delta, per_sample=private)
    return UserDPSGDClient(setup, context, private=private).to_client()


class UserClientLevelClient(ClientLevelDPClient):
    """:class:`ClientLevelDPClient` with a mechanism given as an object (not read from a run-config), the user's loss
    in local training and evaluation."""

    def __init__(self, setup: UserSetup, client_dp: ClientDPConfig, context: Context, dp: ClientLevelDP) -> None:
        super().__init__(setup, client_dp, context, private=True)
        self.dp = dp

    def mechanism(self) -> ClientLevelDP:
        return self.dp

    def local_train(self, model: nn.Module, *, lr: float, seed: int, config: dict[str, Any]) -> TrainResult:
        assert isinstance(self.s, UserSetup)
        spec = LocalTraining(batch_size=self.s.profile.batch_size, steps=self.local_steps(), lr=lr,
                             momentum=float(self.s.training.momentum), seed=seed, loss=self.s.loss)
        return local_train(model, self.s.train, spec, self.s.device)

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict[str, Any]]:
        assert isinstance(self.s, UserSetup)
        return _evaluate(self.s, parameters)


def client_level_client(model: nn.Module, train: UserData, test: UserData | None = None, *, context: Context,
                        mechanism: ClientLevelDP, lr: float, momentum: float = 0.0, lr_decay: float = 1.0,
                        local_epochs: int = 1, local_steps: int = 0, batch_size: int | None = None,
                        loss: Loss | None = None, client_id: int | None = None, device: str = "cpu",
                        seed: int = 0) -> Client:
    """A Flower ``Client`` for :func:`~fedapp.library.server.dp_fedavg`: ``local_steps`` (0: ``local_epochs``·⌈N/b⌉)
    plain momentum-SGD steps from the global model, then the update clipped to ``mechanism.clip`` plus its share of
    the Gaussian noise N(0, C²σ²/r). ``mechanism`` must be the server's (:func:`client_level_mechanism` with the same
    arguments on both sides); a round whose σ differs from the server's, or past ``mechanism.rounds``, is refused.

    Guarantee: the client's whole dataset (client-level DP), ε of ``mechanism`` against the server, which sees every
    update (no SecAgg+ here). No per-sample gradients: any model and loss that train with SGD will do."""
    if mechanism.secure_aggregation:
        raise ValueError("mechanism.secure_aggregation = True needs the project's SecAgg+ client mod; build the "
                         "mechanism with fedapp.library.client_level_mechanism(...), which runs without it")
    training = TrainingConfig(local_epochs=local_epochs, clip_norm=mechanism.clip, dp_rounds=mechanism.rounds,
                              lr=lr, momentum=momentum, lr_decay=lr_decay, accountant=mechanism.accountant)
    setup = _setup(model, train, test, context, training=training, batch_size=batch_size, loss=loss,
                   client_id=client_id, device=device, seed=seed, rounds=mechanism.rounds, epsilon=1.0,
                   delta=mechanism.delta, per_sample=False)
    client_dp = ClientDPConfig(secure_aggregation=False, local_steps=local_steps)
    return UserClientLevelClient(setup, client_dp, context, mechanism).to_client()
