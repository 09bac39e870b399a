"""Device correctness without a GPU: nothing in fedapp/ or strategies/ may put a tensor on a hard-coded device.

One place decides the device (``fedapp.clients.training.resolve_device``); every client passes it down. Two checks
catch the bug class ("Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same")
on a CPU-only machine:

* **dynamic** — every client family's ``fit`` (and the training loop in each of its configurations, evaluation,
  SoteriaFL's gradient oracle) runs with the *meta* device as the chosen device, under a dispatch mode that
  fails on any aten op mixing devices (a CPU-built model fed device inputs, a ``torch.zeros(...)`` without
  ``device=`` added to a device tensor, optimizer state or noise on the CPU...). Meta tensors have no data,
  so the run must end at its first host read (``float(loss)``, ``.cpu()``) *with meta tensors*: a client that
  ignores the chosen device and trains on the CPU finishes instead and fails the test. Stock PyTorch does
  not check every op (a meta input through a CPU convolution passes silently): the dispatch mode does.
* **static** — every tensor factory called in fedapp/ or strategies/ names its ``device`` (or is moved with
  ``.to(...)`` right away), except the host-side ones listed below with the reason they are on the CPU.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REPO, client_context
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fedapp.clients.training import SAM, LocalTraining, PerSampleDP, evaluate_model, get_weights, local_train
from fedapp.data.datasets import ArrayDataset
from fedapp.models.zoo import build_model

META = torch.device("meta")
META_READ = r"meta tensor"  # "Tensor.item() cannot be called on meta tensors", "Cannot copy out of meta tensor"

#: aten ops whose job is to move data between devices (``.to``, ``load_state_dict``'s ``copy_``)
TRANSFERS = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::lift_fresh"}


class SameDevice(TorchDispatchMode):
    """Fail on any aten op whose tensor arguments live on different devices (0-dim CPU scalars excepted)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func._schema.name not in TRANSFERS:
            devices = {t.device for t in tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
            if len(devices) > 1:
                raise AssertionError(f"{func._schema.name} mixes devices {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def _runs_on_meta_until_first_read(fn, *args: Any, **kwargs: Any) -> None:
    # A Poisson batch's size depends on its sampling mask: meta's nonzero() then assumes every record is in,
    # so the run goes on through the forward and backward pass to its first real host read.
    from torch.fx.experimental import _config as fx_config

    with pytest.raises((RuntimeError, NotImplementedError), match=META_READ), SameDevice(), \
            fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        fn(*args, **kwargs)


def test_the_checker_catches_the_bug_class():
    """A model left on the CPU and a device-less factory, both with meta inputs: caught (stock torch misses the first)."""
    conv = torch.nn.Conv2d(1, 2, 3)
    conv(torch.ones(1, 1, 4, 4, device=META))  # no error without the checker
    with pytest.raises(AssertionError, match="mixes devices"), SameDevice():
        conv(torch.ones(1, 1, 4, 4, device=META))
    with pytest.raises(AssertionError, match="mixes devices"), SameDevice():
        torch.ones(3, device=META) * torch.zeros(3)


# ------------------------------------------------------------------------------ the one training loop
def _digits(n: int = 16) -> ArrayDataset:
    rng = np.random.default_rng(0)
    return ArrayDataset(rng.normal(size=(n, 1, 8, 8)).astype(np.float32), (np.arange(n) % 10).astype(np.int64), 10)


LOOPS = {
    "sgd-momentum": LocalTraining(batch_size=4, steps=2, lr=0.1, momentum=0.9),
    "head-only": LocalTraining(batch_size=4, steps=2, lr=0.1, trainable=("fc.weight", "fc.bias")),
    "sam": LocalTraining(batch_size=4, steps=2, lr=0.1, sam=SAM(0.05)),
    "asam": LocalTraining(batch_size=4, steps=2, lr=0.1, momentum=0.5, sam=SAM(0.05, adaptive=True)),
    **{f"dp-{mode}": LocalTraining(batch_size=4, steps=2, lr=0.1, momentum=0.5, dp=PerSampleDP(1.0, 1.0, mode))
       for mode in ("hooks", "ew", "functorch")},
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_training_loop_follows_the_chosen_device(loop: str):
    model = build_model("cnn-digits", (1, 8, 8), 10)
    _runs_on_meta_until_first_read(local_train, model, _digits(), LOOPS[loop], META)
    assert {p.device for p in model.parameters()} == {META}


def test_regularized_model_and_evaluation_follow_the_chosen_device():
    data = ArrayDataset(_digits().x.reshape(16, 64), _digits().y, 10)
    model = build_model("logreg", (64,), 10, nonconvex_lambda=0.1)  # regularizer built on the model's device
    _runs_on_meta_until_first_read(local_train, model, data, LocalTraining(batch_size=4, steps=1, lr=0.1), META)
    _runs_on_meta_until_first_read(evaluate_model, build_model("cnn-digits", (1, 8, 8), 10), _digits(), device=META)


def test_soteriafl_gradient_oracle_follows_the_chosen_device():
    from strategies.soteriafl import GradientOracle

    model = build_model("mlp-digits", (1, 8, 8), 10)
    flat = np.concatenate([w.ravel() for w in get_weights(model)])
    oracle = GradientOracle(model, _digits().x, _digits().y, META)
    _runs_on_meta_until_first_read(oracle.per_sample, flat, np.arange(4))
    _runs_on_meta_until_first_read(oracle.loss_and_grad, flat)


# ------------------------------------------------------------------------------ one client fit per family
FAMILY_BASE = {"dataset": "digits", "privacy-dist": "fixed", "epsilon": 5.0, "batch-size": 8, "max-samples": 200,
               "num-server-rounds": 2, "clients-per-round": 2, "noise-multiplier": 1.0, "clip-norm": 0.5,
               "local-test-fraction": 0.1, "dp2-tau-h": 1, "dp2-tau-phi": 1}


def _client(strategy: str):
    from fedapp.clients.client_dp import ClientLevelDPClient
    from fedapp.clients.common import setup_client
    from fedapp.clients.dp2_fedsam import DP2FedSAMClient
    from fedapp.clients.dpsgd import DPSGDClient
    from fedapp.clients.soteriafl import SoteriaFLClient
    from fedapp.config import resolve_config
    from strategies.dp2_fedsam import VARIANTS

    ctx = client_context(run_id=0, node_id=1)
    ov = {**FAMILY_BASE, "strategy": strategy}
    cfg = resolve_config(None, ov)
    setup = dataclasses.replace(setup_client(ctx, ov), device=META)
    if strategy in ("dpsgd-fedavg", "fedavg"):
        return DPSGDClient(setup, ctx, private=strategy != "fedavg")
    if strategy in ("dp-fedavg", "fedavg-randk"):
        return ClientLevelDPClient(setup, cfg.client_dp, ctx, private=strategy == "dp-fedavg")
    if strategy in VARIANTS:
        return DP2FedSAMClient(setup, cfg.client_dp, cfg.dp2_fedsam, ctx, VARIANTS[strategy])
    return SoteriaFLClient(setup, cfg.soteriafl, ctx)


@pytest.mark.parametrize("strategy", ["fedavg", "dpsgd-fedavg", "dp-fedavg", "dp2-fedsam", "dp-fedsam-ft",
                                      "soteriafl-svrg"])
def test_client_fit_of_every_family_trains_on_the_chosen_device(strategy: str):
    client = _client(strategy)
    config = {"server-round": 1, "round-seed": 11, "soteriafl-method": strategy}
    if strategy == "dp-fedavg":
        config["dp-round-clients"] = 2
    _runs_on_meta_until_first_read(client.fit, client.get_parameters({}), config)


def test_finetuning_evaluation_trains_on_the_chosen_device():
    client = _client("dp-fedsam-ft")
    _runs_on_meta_until_first_read(client.evaluate, client.get_parameters({}), {"server-round": 1})


# ------------------------------------------------------------------------------ static: factories name a device
FACTORIES = {"zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange", "linspace",
             "logspace", "eye", "tensor", "as_tensor", "asarray", "normal", "from_numpy", "scalar_tensor",
             "empty_strided"}

#: (file, function, call) → why this tensor is on the CPU on purpose
HOST_SIDE = {
    ("fedapp/apps/server_app.py", "dry_run", "torch.from_numpy(test.x[:2].copy())"):
        "config dry run: a freshly built CPU model on two CPU samples, no device involved",
    ("fedapp/apps/server_app.py", "dry_run", "torch.zeros((2, *run_schema(cfg.data).input_shape))"):
        "config dry run of node-local data: a freshly built CPU model on two zero inputs of the schema's shape",
    ("fedapp/library/clients.py", "_output_width", "torch.as_tensor(data.x[:2])"):
        "library model check: a CPU copy of the user's module on two host records, before any training",
    ("fedapp/library/evaluation.py", "check_model", "torch.as_tensor(data.x[:2])"):
        "library model check: the user's module (checked before it is moved) on two host records",
    ("fedapp/library/evaluation.py", "check_model", "torch.as_tensor(data.y[:2])"):
        "library model check: the labels of the two host records the loss is tried on",
    ("fedapp/clients/training.py", "set_weights", "torch.as_tensor(np.asarray(w), dtype=old.dtype)"):
        "staging copy of a numpy array; load_state_dict copies it onto the model's own device",
    ("fedapp/clients/training.py", "_shuffled_batches", "torch.from_numpy(rng.permutation(len(y)))"):
        "an epoch's permutation of the host copy of the dataset; each batch is moved to the device in local_train",
    ("fedapp/clients/training.py", "local_train", "torch.from_numpy(data.x)"):
        "host data of the non-private loop; each batch is moved (xb.to)",
    ("fedapp/clients/training.py", "local_train", "torch.from_numpy(data.y)"):
        "host data of the non-private loop; each batch is moved (yb.to)",
    ("fedapp/clients/training.py", "_poisson_batches", "torch.empty((), dtype=torch.int64)"):
        "the base-seed draw a DataLoader iterator takes from the host generator, kept so CPU runs match Opacus' loader",
    ("fedapp/clients/graphed_dpsgd.py", "padded_poisson_epochs", "torch.empty((), dtype=torch.int64)"):
        "the same base-seed draw, so the padded batches are _poisson_batches' draw for draw",
    ("fedapp/clients/noise.py", "add_noise_", "torch.empty(total, dtype=sums[0].dtype)"):
        "the parallel noise buffer (kept by the optimizer), made only when every clipped sum is on the CPU",
    ("fedapp/clients/noise.py", "add_noise_", "torch.randint(_SEED_HIGH, (threads,), generator=generator, dtype=torch.int64)"):
        "the per-thread seeds of the parallel noise, drawn from the CPU generator of CPU-only clipped sums",
}


def _device_less_factories() -> set[tuple[str, str, str]]:
    found = set()
    for root in ("fedapp", "strategies"):
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in FACTORIES):
                    continue
                owner = node.func.value  # torch.x(...) or self.torch.x(...)
                if not ((isinstance(owner, ast.Name) and owner.id == "torch")
                        or (isinstance(owner, ast.Attribute) and owner.attr == "torch")):
                    continue
                parent = parents.get(node)
                if any(k.arg == "device" for k in node.keywords) or (
                        isinstance(parent, ast.Attribute) and parent.attr == "to"):
                    continue
                scope = node
                while scope in parents and not isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                    scope = parents[scope]
                found.add((path.relative_to(REPO).as_posix(), getattr(scope, "name", "<module>"), ast.unparse(node)))
    return found


def test_every_tensor_factory_names_its_device_or_is_host_side_on_purpose():
    found = _device_less_factories()
    new = sorted(found - set(HOST_SIDE))
    assert not new, ("tensor factories without device= (pass the tensor's device, e.g. device=p.device, or add them "
                     f"to HOST_SIDE with the reason they live on the CPU): {new}")
    assert not set(HOST_SIDE) - found, f"stale HOST_SIDE entries: {sorted(set(HOST_SIDE) - found)}"
