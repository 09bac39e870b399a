"""A local Ray head without the daemons a simulation never uses (issue 15: ~0.18 GB and three process starts).

``ray.init()`` on a machine with no cluster starts, besides the GCS and the raylet a simulation needs, the
autoscaler monitor (nothing to autoscale on one machine), the log monitor (it streams worker logs to the driver,
which Flower's ``log_to_driver=False`` turns off) and the dashboard API server (Ray's job and state HTTP APIs,
which neither Flower nor this project call) — ~50-75 MB of PSS each, measured in docs/benchmarks.md, and three
Python processes that start while round 1 does. Ray has switches for all three in ``RayParams``
(``no_monitor``, ``include_log_monitor``; a head whose API server is absent is a state Ray already runs in when
it fails to start), but ``ray.init`` does not pass them through. :func:`lean_local_ray_head` sets them on the
one ``Node`` that ``ray.init`` creates for a new local cluster, and nothing else: attaching to an existing
cluster (``ray_address``) is untouched, and so are the raylet, its dashboard agent (metrics) and its runtime-env
agent (Flower's ``runtime_env`` needs it).

These are Ray internals (``ray._private.node.Node``): the patch checks that they have the shape it expects and
otherwise leaves ``ray.init`` alone with a warning, so a Ray upgrade costs memory, not a run.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

_lock = threading.Lock()


def _patchable() -> type | None:
    """``ray._private.node.Node`` if it has the parameters and methods this module sets, else None."""
    try:
        from ray._private.node import Node
        from ray._private.parameter import RayParams
    except ImportError:
        return None
    params = inspect.signature(RayParams.__init__).parameters
    node = inspect.signature(Node.__init__).parameters
    if not {"no_monitor", "include_log_monitor"} <= params.keys() or not {"head", "ray_init_cluster"} <= node.keys():
        return None
    if not callable(getattr(Node, "start_api_server", None)):
        return None
    return Node


@contextlib.contextmanager
def lean_local_ray_head() -> Iterator[bool]:
    """While open, a ``ray.init`` that starts a new local cluster starts it without the autoscaler monitor, the
    log monitor and the dashboard API server. Yields whether the patch is in place."""
    node_cls = _patchable()
    if node_cls is None:
        log.warning("this Ray's internals differ from ray 2.55's; starting Ray with all of its daemons")
        yield False
        return
    with _lock:
        original_init = node_cls.__init__

        def lean_init(self, ray_params, head=False, *args, **kwargs):  # type: ignore[no-untyped-def]
            if head and kwargs.get("ray_init_cluster"):
                ray_params.no_monitor = True
                ray_params.include_log_monitor = False
                self.start_api_server = lambda **_: None  # instance attribute: this head only
            original_init(self, ray_params, head, *args, **kwargs)

        node_cls.__init__ = lean_init
        try:
            yield True
        finally:
            node_cls.__init__ = original_init
