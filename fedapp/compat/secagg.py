"""Flower's SecAgg+ with faster Shamir arithmetic and X25519 key agreement.

Flower's SecAgg+ client mod and server workflow call ``create_shares`` / ``combine_shares`` through names imported
into their own modules (pycryptodome's pure-Python field arithmetic). :func:`use_shamir` points those two names at
drop-in replacements — the project's own :mod:`fedapp.privacy.shamir`: same field, same share format, 10-20x faster
share creation and 25-230x faster reconstruction at 10-100 clients (benchmarks/shamir.py). Before it patches, it
checks the flwr version and the two names' signatures (:mod:`fedapp.compat.surface`, group ``secagg.shamir``) and
that each replacement takes the same parameters, and raises a RuntimeError naming the symbol and the installed flwr
otherwise. Switched on by the SecAgg+ code paths only, before either handles a message: the server's SecAgg+ workflow
(``fedapp.privacy.secure_aggregation.run_with_secure_aggregation``) and the client mod (``secagg_mod``). Idempotent.

:func:`use_key_agreement` does the same for the key-agreement names (group ``secagg.keys``): the client mod's six
(key generation, raw encodings, agreement) and the workflow's three (it agrees a dropped client's pairwise keys),
pointed at :mod:`fedapp.privacy.key_agreement` (X25519 with raw 32-byte keys instead of P-384 with PEM keys; the
same derivation). Both ends must run it, so the same two code paths switch it on.

:func:`use_masks` does the same for the mask generator both ends call (group ``secagg.masks``): the client mod's and
the workflow's ``pseudo_rand_gen``, pointed at :func:`fedapp.privacy.masks.pseudo_rand_gen` (AES-256-CTR keyed by the
whole secret instead of MT19937 seeded with a 32-bit fold of it).

What the project's SecAgg+ adapter (``fedapp.privacy.secure_aggregation.DPSecAggPlusWorkflow``) overrides and the DDG
transport relies on is registered in the surface too (groups ``secagg.workflow``, ``secagg.transport``) and checked by
``tests/unit/fedapp/compat/test_surface.py``; they are subclassed and called, not patched.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from fedapp.compat import surface

SHAMIR = "secagg.shamir"
#: where Flower's SecAgg+ looks up its Shamir functions: the client mod's ``create_shares``, the workflow's
#: ``combine_shares``
CREATE_SHARES = "flwr.client.mod.secure_aggregation.secaggplus_mod.create_shares"
COMBINE_SHARES = "flwr.server.workflow.secure_aggregation.secaggplus_workflow.combine_shares"
SHAMIR_CALLERS = (CREATE_SHARES, COMBINE_SHARES)

KEYS = "secagg.keys"
_MOD = "flwr.client.mod.secure_aggregation.secaggplus_mod"
_WORKFLOW = "flwr.server.workflow.secure_aggregation.secaggplus_workflow"
#: the key-agreement names Flower's SecAgg+ looks up in its own modules
KEY_CALLERS = tuple(f"{_MOD}.{name}" for name in ("generate_key_pairs", "private_key_to_bytes", "public_key_to_bytes",
                                                  "bytes_to_private_key", "bytes_to_public_key",
                                                  "generate_shared_key")) + \
    tuple(f"{_WORKFLOW}.{name}" for name in ("bytes_to_private_key", "bytes_to_public_key", "generate_shared_key"))

MASKS = "secagg.masks"
#: where Flower's SecAgg+ draws its private and pairwise masks: the client mod masks, the workflow unmasks
MASK_CALLERS = (f"{_MOD}.pseudo_rand_gen", f"{_WORKFLOW}.pseudo_rand_gen")

_lock = threading.Lock()


def _parameters(fn: Callable[..., object]) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults (annotations aside: the replacements' are postponed strings)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _use(group: str, what: str, wanted: dict[str, Callable[..., object]]) -> None:
    """Point each Flower name of ``wanted`` at its replacement, after checking the group and the parameters."""
    if all(surface.resolve(path) is fn for path, fn in wanted.items()):
        return
    with _lock:
        found = surface.problems(group)
        if not found:  # every name resolves: the replacements must take Flower's parameters
            found = [f"{fn.__module__}.{fn.__qualname__}{inspect.signature(fn)} cannot replace "
                     f"{path}{inspect.signature(flower)}" for path, fn in wanted.items()
                     if _parameters(fn) != _parameters(flower := surface.library_object(path))]
        if found:
            raise RuntimeError(f"Flower's SecAgg+ {what} ({', '.join(wanted)}) are left as they are, under flwr "
                               f"{surface.installed_version('flwr')}: " + "; ".join(found))
        for path, fn in wanted.items():
            surface.replace(path, fn)


def use_shamir(create_shares: Callable[[bytes, int, int], list[bytes]],
               combine_shares: Callable[[list[bytes]], bytes]) -> None:
    """Make Flower's SecAgg+ (client mod and server workflow) share and reconstruct secrets with these functions."""
    _use(SHAMIR, "Shamir functions", {CREATE_SHARES: create_shares, COMBINE_SHARES: combine_shares})


def use_key_agreement(module: ModuleType) -> None:
    """Make Flower's SecAgg+ (client mod and server workflow) generate, encode and agree keys with ``module``'s
    functions of the same names (:mod:`fedapp.privacy.key_agreement`)."""
    _use(KEYS, "key-agreement functions", {path: getattr(module, path.rsplit(".", 1)[1]) for path in KEY_CALLERS})


def use_masks(pseudo_rand_gen: Callable[[bytes, int, list[tuple[int, ...]]], list[Any]]) -> None:
    """Make Flower's SecAgg+ (client mod and server workflow) draw its masks with ``pseudo_rand_gen``."""
    _use(MASKS, "mask generator", dict.fromkeys(MASK_CALLERS, pseudo_rand_gen))
