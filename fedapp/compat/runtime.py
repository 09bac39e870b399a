"""Where a ClientApp runs: on a SuperNode (a deployment, with its own operator) or in a simulation.

Flower's SuperNode runs every ClientApp through ``flwr.supernode.runtime.run_clientapp`` (the ``flwr-clientapp``
process it spawns, or one an operator starts with ``--isolation process``); Flower's simulation runs them in Ray actors
(or, in this project's in-process loops, in the caller), which never import that module. Checked against the installed
flwr by ``tests/unit/fedapp/compat/test_runtime.py`` (written for 1.41).
"""

from __future__ import annotations

import sys

#: the module through which a SuperNode runs a ClientApp (flwr 1.41-1.42)
SUPERNODE_CLIENTAPP_MODULE = "flwr.supernode.runtime.run_clientapp"


def on_supernode() -> bool:
    """Whether this process runs ClientApps for a Flower SuperNode (a deployment), not for a simulation."""
    return SUPERNODE_CLIENTAPP_MODULE in sys.modules
