"""Flower's SecAgg+ with faster Shamir arithmetic.

Flower's SecAgg+ client mod and server workflow call ``create_shares`` / ``combine_shares`` through names imported
into their own modules (pycryptodome's pure-Python field arithmetic). :func:`use_shamir` points those two names at
drop-in replacements — the project's own :mod:`fedapp.privacy.shamir`: same field, same share format, 10-20x faster
share creation and 25-230x faster reconstruction at 10-100 clients (benchmarks/shamir.py). Before it patches, it
checks the flwr version and the two names' signatures (:mod:`fedapp.compat.surface`, group ``secagg.shamir``) and
that each replacement takes the same parameters, and raises a RuntimeError naming the symbol and the installed flwr
otherwise. Switched on by the SecAgg+ code paths only, before either handles a message: the server's SecAgg+ workflow
(``fedapp.privacy.secure_aggregation.run_with_secure_aggregation``) and the client mod (``secagg_mod``). Idempotent.

What the project's SecAgg+ adapter (``fedapp.privacy.secure_aggregation.DPSecAggPlusWorkflow``) overrides and the DDG
transport relies on is registered in the surface too (groups ``secagg.workflow``, ``secagg.transport``) and checked by
``tests/unit/fedapp/compat/test_surface.py``; they are subclassed and called, not patched.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

from fedapp.compat import surface

SHAMIR = "secagg.shamir"
#: where Flower's SecAgg+ looks up its Shamir functions: the client mod's ``create_shares``, the workflow's
#: ``combine_shares``
CREATE_SHARES = "flwr.client.mod.secure_aggregation.secaggplus_mod.create_shares"
COMBINE_SHARES = "flwr.server.workflow.secure_aggregation.secaggplus_workflow.combine_shares"
SHAMIR_CALLERS = (CREATE_SHARES, COMBINE_SHARES)

_lock = threading.Lock()


def _parameters(fn: Callable[..., object]) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults (annotations aside: the replacements' are postponed strings)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def use_shamir(create_shares: Callable[[bytes, int, int], list[bytes]],
               combine_shares: Callable[[list[bytes]], bytes]) -> None:
    """Make Flower's SecAgg+ (client mod and server workflow) share and reconstruct secrets with these functions."""
    wanted: dict[str, Callable[..., object]] = {CREATE_SHARES: create_shares, COMBINE_SHARES: combine_shares}
    if all(surface.resolve(path) is fn for path, fn in wanted.items()):
        return
    with _lock:
        found = surface.problems(SHAMIR)
        if not found:  # both names resolve: the replacements must take Flower's parameters
            found = [f"{fn.__module__}.{fn.__qualname__}{inspect.signature(fn)} cannot replace "
                     f"{path}{inspect.signature(flower)}" for path, fn in wanted.items()
                     if _parameters(fn) != _parameters(flower := surface.library_object(path))]
        if found:
            raise RuntimeError(f"Flower's SecAgg+ Shamir functions ({', '.join(SHAMIR_CALLERS)}) are left as they are, "
                               f"under flwr {surface.installed_version('flwr')}: " + "; ".join(found))
        for path, fn in wanted.items():
            surface.replace(path, fn)
