"""The Flower apps (ServerApp, ClientApp) and the factories that build a run's strategy and clients.

Importing this package in Flower's simulation runtime, with the launcher's switch set, starts the runtime's Ray head
while the apps are still loading (:mod:`fedapp.compat.early_ray`); anywhere else it does nothing."""

from fedapp.compat.early_ray import start_in_simulation_runtime as _start_early_ray

_start_early_ray()
