"""pfl-research written the plain way, as a new user would: the control for ``benchmarks/pfl_side.py``.

The same task as ``pfl_side.py`` (the inputs ``peer_pfl.py`` exports: the MNIST pool as NumPy arrays, the 20
clients' index sets, the test set, the CNN's initial weights, the settings), built only from pfl's documented
pieces with their defaults; of ``pfl_side.py`` it takes only the model, the input loader and the round timer:

* ``FederatedDataset.from_slices`` over per-user NumPy arrays (pfl converts each batch to a tensor), users drawn
  by pfl's ``minimize_reuse`` sampler, a fixed cohort of r users a round;
* ``FederatedAveraging`` as it is (it evaluates the sampled users on their own data before and after local
  training in iteration 0, ``evaluation_frequency`` being larger than the run), ``WeightByUser`` and
  ``CentrallyAppliedPrivacyMechanism(GaussianMechanism(C, σ))``;
* pfl's ``CentralEvaluationCallback`` on the held-out test set every round (pfl evaluates the initial model and
  then every round but the first), and a timer callback last, for per-round wall times.

``peer_pfl.py --pfl-scripts side plain`` runs both alternately; equal per-round time and accuracy show that
``pfl_side.py`` does the work of a plain pfl run and no more.

    /work/pfl-venv/bin/python benchmarks/pfl_plain.py --inputs DIR --out result.json [--seed S]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.central_evaluation import CentralEvaluationCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import StringMetricName
from pfl.model.pytorch import PyTorchModel
from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism
from pfl_side import MnistCNN, RoundTimer, load_inputs


def run(inputs: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """Train as the settings say with a fixed cohort; per-round records and the final central accuracy."""
    s = inputs["settings"]
    n, r, rounds = int(s["num_clients"]), int(s["clients_per_round"]), int(s["rounds"])
    if seed is not None:
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
    x, y = inputs["x"].numpy(), inputs["y"].numpy()
    users = {uid: [x[idx.numpy()], y[idx.numpy()]] for uid, idx in enumerate(inputs["clients"])}
    train_data = FederatedDataset.from_slices(users, get_user_sampler("minimize_reuse", list(range(n))))

    module = MnistCNN()
    module.load_state_dict(inputs["init"], strict=True)
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=float(s["server_lr"])))
    mechanism = CentrallyAppliedPrivacyMechanism(
        GaussianMechanism(clipping_bound=float(s["clip_norm"]), relative_noise_stddev=float(s["noise_multiplier"])))
    backend = SimulatedBackend(training_data=train_data, val_data=None, postprocessors=[WeightByUser(), mechanism])
    algorithm_params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                                         train_cohort_size=r, val_cohort_size=None)
    train_params = NNTrainHyperParams(local_learning_rate=float(s["lr"]), local_num_epochs=int(s["local_epochs"]),
                                      local_batch_size=int(s["batch_size"]))
    eval_params = NNEvalHyperParams(local_batch_size=int(s["eval_batch_size"]))
    test = Dataset(raw_data=[inputs["test_x"].numpy(), inputs["test_y"].numpy()])
    central = CentralEvaluationCallback(test, eval_params, frequency=1,
                                        format_fn=lambda name: StringMetricName(f"Central test | {name}"))
    timer = RoundTimer()
    FederatedAveraging().run(algorithm_params=algorithm_params, backend=backend, model=model,
                             model_train_params=train_params, model_eval_params=eval_params,
                             callbacks=[central, timer])
    return {"rounds": timer.rounds, "final_accuracy": timer.rounds[-1]["accuracy"] if timer.rounds else None,
            "initial": {}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=Path, required=True, help="folder written by benchmarks/peer_pfl.py")
    parser.add_argument("--out", type=Path, required=True, help="JSON result file")
    parser.add_argument("--seed", type=int, default=None, help="seed of torch and NumPy (default: random)")
    args = parser.parse_args(argv)
    import pfl

    t0 = time.perf_counter()
    inputs = load_inputs(args.inputs)
    load_seconds = time.perf_counter() - t0
    result = run(inputs, args.seed)
    result.update(load_seconds=load_seconds, sampling="minimize_reuse", pfl_version=pfl.__version__,
                  torch_version=torch.__version__, torch_threads=torch.get_num_threads())
    args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
