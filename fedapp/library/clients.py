"""The project's DP clients around a user's own model, data and loss, for a user's own ClientApp.

* :func:`dpsgd_client`: record-level DP-SGD (Opacus) with this client's (ε, δ) budget: the client of the Robust-HDP
  family (:func:`~fedapp.library.server.robust_hdp`, :func:`~fedapp.library.server.dpsgd_fedavg`,
  :func:`~fedapp.library.server.weiavg`, :func:`~fedapp.library.server.pfa`, :func:`~fedapp.library.server.min_eps`
  with ε = the federation's minimum; ``private=False``: plain SGD, for :func:`~fedapp.library.server.fedavg`). It is
  :class:`fedapp.clients.dpsgd.DPSGDClient`, unchanged.
* :func:`client_level_client`: client-level clip-and-noise (:class:`fedapp.clients.client_dp.ClientLevelDPClient`,
  without SecAgg+), sparsified by the round's Fed-SMP mask when the server sends one; ``mechanism=None``: the
  non-private FedAvg-randk/topk baselines.
* :func:`ftrl_client`: DP-FTRL's clipping client (:class:`fedapp.clients.client_dp.FTRLClient`, central noise).
* :func:`soteriafl_client`: :class:`fedapp.clients.soteriafl.SoteriaFLClient` (local DP on per-sample gradients).
* :func:`dp2_fedsam_client`: :class:`fedapp.clients.dp2_fedsam.DP2FedSAMClient` (shared body, private head).

Each is built from a :class:`~fedapp.clients.common.ClientSetup` made from the user's objects instead of the
run-config; the node guard of the project's ClientApp (node-config privacy policy, lifetime budgets across runs, the
lost-accountant check, fault injection) is not applied.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.client import Client
from flwr.common import Context
from torch import nn

from fedapp.clients.client_dp import ClientLevelDPClient, FTRLClient
from fedapp.clients.common import ClientSetup
from fedapp.clients.dpsgd import DPSGDClient
from fedapp.clients.training import (
    LocalTraining,
    TrainResult,
    get_weights,
    local_train,
    resolve_device,
    set_weights,
)
from fedapp.config import ClientDPConfig, DataConfig, GeneralConfig, TrainingConfig
from fedapp.data.datasets import ArrayDataset
from fedapp.library.data import UserData, as_array_dataset, loader_batch_size
from fedapp.library.evaluation import Loss, ModelProblem, check_model, evaluate_user_model
from fedapp.library.settings import DP2FedSAMSettings, DPSGDSettings, SecAggSettings, SoteriaFLSettings
from fedapp.models.catalog import GRAD_SAMPLE_MODES, ModelSpec
from fedapp.privacy.profiles import ClientProfile
from strategies.aggregate import flatten
from strategies.privacy.ftrl_accounting import FTRLMechanism
from strategies.privacy.mechanisms import ClientLevelDP
from strategies.soteriafl import SAGA_TABLE_LIMIT_BYTES, GradientOracle, get_method


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
           rounds: int, epsilon: float, delta: float, per_sample: bool, num_clients: int | None = None,
           strategy: str = "dpsgd-fedavg") -> UserSetup:
    train_set = as_array_dataset(train, "train")
    check_model(model, train_set, loss, per_sample=per_sample,
                book_keeping=per_sample and training.grad_sample_mode == "bk")
    template = copy.deepcopy(model)
    test_set = as_array_dataset(test, "test", train_set.num_classes) if test is not None else \
        ArrayDataset(train_set.x[:0], train_set.y[:0], train_set.num_classes)
    b = batch_size if batch_size is not None else loader_batch_size(train)
    if b is None or b < 1:
        raise ValueError(f"batch_size = {b!r}: pass batch_size >= 1, or train as a DataLoader with a batch size")
    if b > len(train_set):
        raise ValueError(f"batch_size = {b} exceeds the {len(train_set)} training records of this client")
    node = context.node_config
    cid = client_id if client_id is not None else node.get("partition-id")
    if cid is None:
        raise ValueError("client_id is needed where the node-config has no 'partition-id' (a deployed SuperNode)")
    if num_clients is None:
        num_clients = int(node.get("num-partitions", 0))
    profile = ClientProfile(int(cid), num_clients, float(epsilon), float(delta), int(b), training.local_epochs,
                            float(epsilon))
    general = GeneralConfig(strategy=strategy, num_server_rounds=rounds, seed=seed)
    training = dataclasses.replace(training, batch_size=int(b))
    spec = ModelSpec(f"user:{type(model).__module__}.{type(model).__qualname__}", seed)
    return UserSetup(general, DataConfig(), training, spec, profile, train_set, test_set, resolve_device(device),
                     template=template, loss=loss)


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
                 allow_large_delta: bool = False, device: str = "cpu", seed: int = 0,
                 grad_sample_mode: str = "hooks") -> Client:
    """A Flower ``Client`` running record-level DP-SGD on ``model`` over ``train`` with budget (``epsilon``,
    ``delta``) for ``settings.rounds`` rounds.

    ``train`` / ``test``: a ``DataLoader`` (its dataset and batch size are used; batches are Poisson-sampled at
    q = 1/⌈N/b⌉, never the loader's), a map-style ``Dataset`` of (x, y) items, or (x, y) arrays. ``loss``: the batch
    mean of per-sample losses (None: cross-entropy on class scores). ``client_id``: default the node-config's
    ``partition-id`` (set by the simulation); it must be unique in the federation. ``context``: the ClientApp's
    ``Context``, whose ``state`` keeps the accountant's history between rounds. ``seed`` seeds only plain SGD's
    shuffling; DP noise and Poisson sampling always come from OS entropy. ``grad_sample_mode``: how per-sample
    gradients are clipped, each giving the same clipped, noised step: Opacus' ``"hooks"`` (its default), ``"ew"``,
    ``"functorch"``, ``"bk"`` (book-keeping, :mod:`fedapp.clients.book_keeping`, the fastest for the catalog's CNNs on a
    CPU in docs/benchmarks.md; checked on your model here) or ``"auto"`` (the fastest that runs, timed on your model's
    shapes at the first round).

    Guarantee: every record of ``train`` is (ε, δ)-DP against anyone who sees this client's updates, the server
    included, over the ``settings.rounds`` rounds (neighbours: ``settings.record_neighbours``). ``test`` is read only
    by ``evaluate``, whose loss and accuracy go to the server unprotected, as in the project's own clients.

    Raises ``ValueError`` (:class:`~fedapp.library.evaluation.ModelProblem`,
    :class:`~fedapp.library.data.DataProblem`) for a model Opacus cannot train, a loss that is not a batch mean, a
    forward pass that fails on the data, or unreadable data; nothing is changed for you."""
    if grad_sample_mode not in ("auto", *GRAD_SAMPLE_MODES):
        raise ValueError(f"grad_sample_mode = {grad_sample_mode!r} must be one of {('auto', *GRAD_SAMPLE_MODES)}")
    training = TrainingConfig(
        privacy_dist="fixed", epsilon=float(epsilon), delta=float(delta), allow_large_delta=allow_large_delta,
        local_epochs=settings.local_epochs, clip_norm=settings.clip_norm, dp_rounds=settings.rounds,
        accountant=settings.accountant, record_neighbours=settings.record_neighbours,
        grad_sample_mode=grad_sample_mode, lr=settings.lr, momentum=settings.momentum, lr_decay=settings.lr_decay)
    if not (epsilon > 0 and np.isfinite(epsilon)) or not 0 < delta < 1:
        raise ValueError(f"epsilon = {epsilon} must be a finite number > 0 and delta = {delta} in (0, 1)")
    setup = _setup(model, train, test, context, training=training, batch_size=batch_size, loss=loss,
                   client_id=client_id, device=device, seed=seed, rounds=settings.rounds, epsilon=epsilon,
                   delta=delta, per_sample=private)
    return UserDPSGDClient(setup, context, private=private).to_client()


class UserClientLevelClient(ClientLevelDPClient):
    """:class:`ClientLevelDPClient` with a mechanism given as an object (not read from a run-config; None: the
    non-private sparsify-and-clip baselines), the user's loss in local training and evaluation.

    Under SecAgg+ (``client_dp.secure_aggregation``) the project's client answers a fit only from inside SecAgg+'s
    collect stage (:func:`fedapp.privacy.secure_aggregation.outside_secagg`): its share carries noise for a sum of r_t
    clients, so it never reaches the server alone (a ClientApp without ``secagg_mod``, a server running
    ``start_grid``)."""

    def __init__(self, setup: UserSetup, client_dp: ClientDPConfig, context: Context, dp: Any) -> None:
        super().__init__(setup, client_dp, context, private=dp is not None)
        self.dp = dp

    def mechanism(self) -> Any:
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
                        mechanism: ClientLevelDP | None, lr: float, clip: float | None = None, momentum: float = 0.0,
                        lr_decay: float = 1.0, local_epochs: int = 1, local_steps: int = 0,
                        batch_size: int | None = None, loss: Loss | None = None, client_id: int | None = None,
                        secagg: SecAggSettings | None = None, device: str = "cpu", seed: int = 0) -> Client:
    """A Flower ``Client`` for :func:`~fedapp.library.server.dp_fedavg` and :func:`~fedapp.library.server.fed_smp`:
    ``local_steps`` (0: ``local_epochs``·⌈N/b⌉) plain momentum-SGD steps from the global model, then the update —
    sparsified by the round's mask when the server sends one (Fed-SMP rand-k / top-k) — clipped to
    ``mechanism.clip`` plus its share of the noise. ``mechanism`` must be the server's
    (:func:`client_level_mechanism` with the same arguments on both sides); a round whose σ differs from the server's,
    or past ``mechanism.rounds``, is refused.

    ``secagg=None``: no SecAgg+, ``mechanism.secure_aggregation`` must be False; each update carries N(0, C²σ²/r).
    ``secagg=SecAggSettings(...)`` (the server's): the mechanism must have ``secure_aggregation = True``; the share is
    the distributed discrete Gaussian's residues modulo 2^``secagg.bits`` of the rotated update (``"ddg"``, the round's
    rotation seed from the server) or the clipped update plus N(0, C²σ²/r_t) (``"gaussian"``), sent with weight 1
    through SecAgg+ only: the ClientApp must have ``mods=[secagg_mod]``
    (:func:`fedapp.privacy.secure_aggregation.secagg_mod`), and a fit outside SecAgg+ is refused.

    ``mechanism=None`` with ``clip``: the non-private baselines of :func:`~fedapp.library.server.sparse_fedavg`
    (sparsify and clip, no noise; the reply then carries the training loss, as FedAvg's does).

    Guarantee (with a mechanism): the client's whole dataset (client-level DP), ε of ``mechanism`` against the server:
    one update's without SecAgg+, the secure sum's with it. No per-sample gradients: any model and loss that train with
    SGD will do."""
    if mechanism is None:
        if clip is None or not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"mechanism=None (no privacy) needs clip, the norm bound of the update; got {clip!r}")
        if secagg is not None:
            raise ValueError("secagg needs a mechanism built with client_level_mechanism(..., secure_aggregation=True)")
    else:
        if clip is not None and clip != mechanism.clip:
            raise ValueError(f"clip = {clip} differs from the mechanism's C = {mechanism.clip}; leave clip out")
        if mechanism.secure_aggregation and secagg is None:
            raise ValueError("mechanism.secure_aggregation = True: pass secagg=SecAggSettings(...) (the server's) and "
                             "add secagg_mod to the ClientApp's mods; without SecAgg+ build the mechanism with "
                             "client_level_mechanism(..., secure_aggregation=False)")
        if secagg is not None and not mechanism.secure_aggregation:
            raise ValueError("secagg given but mechanism.secure_aggregation = False: build the mechanism with "
                             "client_level_mechanism(..., secure_aggregation=True)")
    bound = mechanism.clip if mechanism is not None else float(clip)  # type: ignore[arg-type]
    rounds = mechanism.rounds if mechanism is not None else 1
    training = TrainingConfig(local_epochs=local_epochs, clip_norm=bound, dp_rounds=rounds, lr=lr,
                              momentum=momentum, lr_decay=lr_decay,
                              accountant=mechanism.accountant if mechanism is not None else "rdp")
    setup = _setup(model, train, test, context, training=training, batch_size=batch_size, loss=loss,
                   client_id=client_id, device=device, seed=seed, rounds=rounds, epsilon=1.0,
                   delta=mechanism.delta if mechanism is not None else 0.5, per_sample=False,
                   num_clients=mechanism.num_clients if mechanism is not None else None)
    if secagg is None:
        client_dp = ClientDPConfig(secure_aggregation=False, local_steps=local_steps)
    else:
        client_dp = ClientDPConfig(secure_aggregation=True, secagg_mechanism=secagg.mechanism,
                                   secagg_bits=secagg.bits, secagg_num_shares=secagg.num_shares,
                                   secagg_threshold=secagg.reconstruction_threshold, local_steps=local_steps)
    return UserClientLevelClient(setup, client_dp, context, mechanism).to_client()


class UserFTRLClient(FTRLClient, UserClientLevelClient):
    """:class:`FTRLClient` (its turn schedule, budget check and clipping, unchanged) with the mechanism given as an
    object and the user's loss (:class:`UserClientLevelClient`'s local training and evaluation)."""

    def mechanism(self) -> Any:
        return self.dp


def ftrl_client(model: nn.Module, train: UserData, test: UserData | None = None, *, context: Context,
                mechanism: FTRLMechanism, lr: float, momentum: float = 0.0, lr_decay: float = 1.0,
                local_epochs: int = 1, local_steps: int = 0, batch_size: int | None = None,
                loss: Loss | None = None, client_id: int | None = None, device: str = "cpu", seed: int = 0) -> Client:
    """A Flower ``Client`` for :func:`~fedapp.library.server.dp_ftrl`: the project's DP-FTRL client
    (:class:`fedapp.clients.client_dp.FTRLClient`): in the rounds of its turn (``mechanism.min_separation``; client
    ids must be 0..n−1) local momentum-SGD as :func:`client_level_client`, the update clipped to C and sent without
    noise (the server adds the correlated noise); outside its turn a zero update; a round past ``mechanism.rounds`` or
    a turn already taken is refused. Guarantee: client-level, against whoever sees the released models (not the
    server, which sees the clipped update)."""
    if mechanism.secure_aggregation:
        raise ValueError("mechanism.secure_aggregation = True needs the project's SecAgg+ client mod; build the "
                         "mechanism with fedapp.library.ftrl_mechanism(...)")
    training = TrainingConfig(local_epochs=local_epochs, clip_norm=mechanism.clip, dp_rounds=mechanism.rounds, lr=lr,
                              momentum=momentum, lr_decay=lr_decay)
    setup = _setup(model, train, test, context, training=training, batch_size=batch_size, loss=loss,
                   client_id=client_id, device=device, seed=seed, rounds=mechanism.rounds, epsilon=1.0,
                   delta=mechanism.delta, per_sample=False, num_clients=mechanism.num_clients)
    if not 0 <= setup.profile.client_id < mechanism.num_clients:
        raise ValueError(f"client id {setup.profile.client_id}: DP-FTRL's turns need ids 0..{mechanism.num_clients - 1}")
    client_dp = ClientDPConfig(secure_aggregation=False, local_steps=local_steps,
                               ftrl_min_separation=mechanism.min_separation)
    return UserFTRLClient(setup, client_dp, context, mechanism).to_client()


def _output_width(model: nn.Module, data: ArrayDataset) -> int:
    with torch.no_grad():
        out = copy.deepcopy(model).eval()(torch.as_tensor(data.x[:2]))
    return int(out.shape[1]) if out.dim() == 2 else 0


def _cross_entropy_only(loss: Loss | None, who: str) -> None:
    plain = isinstance(loss, nn.CrossEntropyLoss) and loss.weight is None and loss.reduction == "mean" \
        and loss.label_smoothing == 0.0 and loss.ignore_index == -100
    if loss is not None and not plain:
        raise ModelProblem(f"{who} trains and evaluates with cross-entropy on class scores (the project's client has "
                           f"no loss argument); loss must be None or nn.CrossEntropyLoss(), got {loss!r}")


def _check_soteriafl_model(model: nn.Module, data: ArrayDataset) -> None:
    """What :class:`strategies.soteriafl.GradientOracle` needs of the model, checked on two records: no buffers,
    parameters in ``state_dict`` order, [N, k] class scores and per-sample gradients through ``torch.func``."""
    if data.y.dtype.kind != "i":
        raise ModelProblem("SoteriaFL's gradients are of cross-entropy: the training labels must be integers")
    if _output_width(model, data) <= int(data.y.max()):
        raise ModelProblem(f"model {type(model).__name__} must output [N, k] class scores with k > "
                           f"{int(data.y.max())}, the largest training label")
    try:
        oracle = GradientOracle(copy.deepcopy(model), data.x[:2], data.y[:2])
        grads = oracle.per_sample(flatten(get_weights(model)).astype(np.float64), np.arange(min(2, len(data))))
    except Exception as exc:  # noqa: BLE001 — the model's forward pass is the user's code
        raise ModelProblem(f"model {type(model).__name__}: SoteriaFL's per-sample gradients "
                           f"(strategies.soteriafl.GradientOracle, torch.func.vmap over a training-mode model) fail: "
                           f"{type(exc).__name__}: {exc}. It needs a model without buffers (no BatchNorm) and "
                           "without random layers in training mode (no Dropout)") from None
    if not np.all(np.isfinite(grads)):
        raise ModelProblem(f"model {type(model).__name__}: per-sample gradients on two training records are not finite")


def soteriafl_client(model: nn.Module, train: UserData, test: UserData | None = None, *, context: Context,
                     settings: SoteriaFLSettings, epsilon: float, delta: float, num_clients: int | None = None,
                     loss: Loss | None = None, client_id: int | None = None, allow_large_delta: bool = False,
                     device: str = "cpu", seed: int = 0) -> Client:
    """A Flower ``Client`` for :func:`~fedapp.library.server.soteriafl`: the project's
    :class:`fedapp.clients.soteriafl.SoteriaFLClient`, unchanged, around your model and data. Each round one step of
    ``settings.method``: the gradient estimator over per-sample gradients clipped to G = ``settings.clip_norm``, plus
    N(0, σ_p²) with σ_p calibrated so ``settings.rounds`` rounds spend (``epsilon``, ``delta``), then
    (shift-)compressed. Its state (shift, SVRG snapshot, SAGA table, ledger) lives in ``context.state``; a round that
    would exceed ε is refused, and so is every round when δ > 1/(10 m) unless ``allow_large_delta``.

    What the model must be: per-sample gradients come from :class:`strategies.soteriafl.GradientOracle`
    (``torch.func``'s ``vmap(grad(...))`` of cross-entropy on the model in training mode), so no buffers (BatchNorm),
    no random layers (Dropout), [N, k] class scores, integer labels, and ``loss`` None or plain
    ``nn.CrossEntropyLoss()``. Anything else raises :class:`ModelProblem`. ``num_clients`` n (default the node-config's
    ``num-partitions``) is needed only by ``soteriafl-sgd``'s default minibatch rule (``settings.batch_size = 0``).

    Guarantee: every record of ``train`` is (ε, δ)-DP (record-level, ``settings.record_neighbours``) against anyone
    who sees this client's messages, the server included. ``test`` goes only into the unprotected evaluation replies."""
    from fedapp.clients.soteriafl import SoteriaFLClient
    from fedapp.config import SoteriaFLConfig

    if not (epsilon > 0 and np.isfinite(epsilon)) or not 0 < delta < 1:
        raise ValueError(f"epsilon = {epsilon} must be a finite number > 0 and delta = {delta} in (0, 1)")
    _cross_entropy_only(loss, "SoteriaFL")
    if not isinstance(model, nn.Module):
        raise ModelProblem(f"model is a {type(model).__name__}, not a torch.nn.Module")
    train_set = as_array_dataset(train, "train")
    check_model(model, train_set, None, per_sample=False)
    _check_soteriafl_model(model, train_set)
    m, d = len(train_set), int(sum(p.numel() for p in model.parameters()))
    if settings.batch_size > m:
        raise ValueError(f"settings.batch_size = {settings.batch_size} exceeds this client's m = {m} records")
    method = get_method(settings.method)
    if method.estimator == "saga" and 4 * m * d > SAGA_TABLE_LIMIT_BYTES:
        raise ValueError(f"the SAGA table m·d = {m}·{d} floats exceeds {SAGA_TABLE_LIMIT_BYTES // 2**20} MiB; use "
                         "soteriafl-svrg or fewer records")
    node_n = int(context.node_config.get("num-partitions", 0))
    n = num_clients if num_clients is not None else node_n
    if settings.batch_size == 0 and method.estimator == "sgd" and n < 1:
        raise ValueError("soteriafl-sgd's default minibatch rule needs the number of clients: pass num_clients, or "
                         "settings.batch_size > 0")
    training = TrainingConfig(privacy_dist="fixed", epsilon=float(epsilon), delta=float(delta),
                              allow_large_delta=allow_large_delta, clip_norm=settings.clip_norm,
                              dp_rounds=settings.rounds, accountant=settings.accountant,
                              record_neighbours=settings.record_neighbours)
    setup = _setup(model, train, test, context, training=training, batch_size=1, loss=None, client_id=client_id,
                   device=device, seed=seed, rounds=settings.rounds, epsilon=epsilon, delta=delta, per_sample=False,
                   num_clients=n, strategy=settings.method)
    options = SoteriaFLConfig(soteriafl_k=settings.k, soteriafl_gamma=settings.gamma,
                              soteriafl_batch_size=settings.batch_size, soteriafl_snapshot_prob=settings.snapshot_prob,
                              soteriafl_eta=settings.eta)
    return SoteriaFLClient(setup, options, context).to_client()


def dp2_fedsam_client(model: nn.Module, train: UserData, test: UserData | None = None, *, context: Context,
                      mechanism: ClientLevelDP, settings: DP2FedSAMSettings, lr: float, momentum: float = 0.0,
                      lr_decay: float = 1.0, local_epochs: int = 1, batch_size: int | None = None,
                      loss: Loss | None = None, client_id: int | None = None, device: str = "cpu",
                      seed: int = 0) -> Client:
    """A Flower ``Client`` for :func:`~fedapp.library.server.dp2_fedsam`: the project's
    :class:`fedapp.clients.dp2_fedsam.DP2FedSAMClient`, unchanged, around your model and data. Personalized variants
    split your model by ``settings.head`` (parameter-name prefixes) into the shared body φ and a personal head h_i,
    kept in ``context.state``: each round τ_h epochs of SGD on h (φ fixed), then τ_φ epochs of SAM (CENTAUR: SGD) on φ
    (h fixed); only Δφ, clipped to C plus N(0, C²σ²/r), is sent. Full-model variants train ``local_epochs`` epochs of
    SAM / SGD on everything. The round's mechanism is ``mechanism`` (:func:`client_level_mechanism`, as on the
    server); the budget ε of ``mechanism`` (or node-config ``epsilon``) is enforced.

    The project's client trains and evaluates with cross-entropy: ``loss`` must be None or ``nn.CrossEntropyLoss()``.
    Guarantee: the client's whole dataset (client-level DP, the shared part's updates), against the server, which sees
    every update (no SecAgg+ here); the head never leaves the client."""
    from fedapp.clients.dp2_fedsam import DP2FedSAMClient
    from fedapp.config import DP2FedSAMConfig, GeneralConfig
    from fedapp.privacy.profiles import client_level_mechanism as configured_mechanism
    from strategies.dp2_fedsam import get_variant, shared_mask

    _cross_entropy_only(loss, "DP2-FedSAM")
    if mechanism.secure_aggregation:
        raise ValueError("mechanism.secure_aggregation = True needs the project's SecAgg+ client mod; build the "
                         "mechanism with fedapp.library.client_level_mechanism(...)")
    variant = get_variant(settings.variant)
    if isinstance(model, nn.Module):
        try:
            shared_mask(model, settings.head, variant.personalized)
        except ValueError as exc:
            raise ModelProblem(f"head = {settings.head!r}: {exc}") from None
    # the project's client derives its mechanism from config sections: these give exactly ``mechanism``
    r, n = mechanism.clients_per_round, mechanism.num_clients
    training = TrainingConfig(local_epochs=local_epochs, clip_norm=mechanism.clip, dp_rounds=mechanism.rounds, lr=lr,
                              momentum=momentum, lr_decay=lr_decay, accountant=mechanism.accountant,
                              allow_large_delta=True)
    client_dp = ClientDPConfig(noise_multiplier=mechanism.noise_multiplier, client_delta=mechanism.delta,
                               secure_aggregation=False, client_dp_adversary=mechanism.adversary)
    general = GeneralConfig(num_server_rounds=mechanism.rounds, clients_per_round=r if r < n else 0)
    if configured_mechanism(general, training, client_dp, n) != mechanism:
        raise ValueError(f"the DP2-FedSAM client cannot reproduce mechanism {mechanism} from its configuration")
    setup = _setup(model, train, test, context, training=training, batch_size=batch_size, loss=None,
                   client_id=client_id, device=device, seed=seed, rounds=mechanism.rounds, epsilon=1.0,
                   delta=mechanism.delta, per_sample=False, num_clients=n, strategy=settings.variant)
    setup.general = dataclasses.replace(setup.general, clients_per_round=general.clients_per_round)
    dp2 = DP2FedSAMConfig(dp2_head=settings.head, dp2_tau_h=settings.tau_h, dp2_tau_phi=settings.tau_phi,
                          dp2_lr_head=settings.lr_head, sam_rho=settings.sam_rho, sam_adaptive=settings.sam_adaptive,
                          sam_eta=settings.sam_eta, ft_epochs=settings.ft_epochs, dp2_eval_every=settings.eval_every)
    return DP2FedSAMClient(setup, client_dp, dp2, context, variant).to_client()
