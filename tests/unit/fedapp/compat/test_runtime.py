"""fedapp.compat.runtime: the module that marks a SuperNode's ClientApp process exists in this Flower, is what the
``flwr-clientapp`` entry point runs, and is absent from a process that only simulates."""

from __future__ import annotations

import importlib
import subprocess
import sys

from fedapp.compat.runtime import SUPERNODE_CLIENTAPP_MODULE, on_supernode


def test_the_supernode_clientapp_module_is_flowers_clientapp_runtime():
    module = importlib.import_module(SUPERNODE_CLIENTAPP_MODULE)
    assert callable(module.run_clientapp)
    cli = importlib.import_module("flwr.supernode.cli.flwr_clientapp")
    # the process flower-supernode spawns for every ClientApp runs this module's function (compared by name: the
    # conftest drops this module from sys.modules before each test, so an earlier import of the cli module may hold
    # the function of an earlier instance of it)
    ran = cli.run_clientapp
    assert (ran.__module__, ran.__qualname__) == (SUPERNODE_CLIENTAPP_MODULE, "run_clientapp")


def test_a_simulation_process_is_not_a_supernode():
    code = ("import flwr.simulation, flwr.clientapp, flwr.serverapp; import fedapp.apps.client_app; "
            "from fedapp.compat.runtime import on_supernode; print(on_supernode())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "False"
    code = f"import {SUPERNODE_CLIENTAPP_MODULE}; from fedapp.compat.runtime import on_supernode; print(on_supernode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "True"
    assert isinstance(on_supernode(), bool)
