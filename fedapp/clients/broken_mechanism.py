"""A test-only fault that breaks a mechanism on purpose, so that a test can show the privacy audit catching it.

Environment variable ``DPFL_TEST_NOISE_SCALE`` (e.g. ``0.1``) multiplies the continuous Gaussian noise the client-level
clients add (:meth:`fedapp.clients.client_dp.ClientLevelDPClient.privatize`, without SecAgg+'s discrete Gaussian) and
the DP-SGD clients' noise multiplier in training (:class:`fedapp.clients.dpsgd.DPSGDClient`; their accountant still
charges the calibrated one). It is not a run-config or node-config key, nothing in the project sets it, and a ClientApp
on a SuperNode (:func:`fedapp.compat.runtime.on_supernode`) ignores it: a deployment's guarantee never depends on the
environment.
"""

from __future__ import annotations

import math
import os

from fedapp.compat.runtime import on_supernode

ENV = "DPFL_TEST_NOISE_SCALE"


def noise_scale_fault() -> float:
    """The factor on the client-level Gaussian noise and the DP-SGD noise multiplier: 1 unless a test set :data:`ENV`
    in a simulation."""
    raw = os.environ.get(ENV)
    if raw is None or on_supernode():
        return 1.0
    value = float(raw)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{ENV} = {raw!r} must be a finite number > 0")
    return value


