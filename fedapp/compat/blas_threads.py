"""BLAS thread pools in a Ray actor, sized to the CPUs Ray gave the actor.

Ray tells an actor how many threads to run through ``OMP_NUM_THREADS`` (its ``num_cpus``), set in the worker's
environment when the actor starts. A worker that loaded numpy before that (Ray prestarts workers, and its own modules
import numpy) has already sized OpenBLAS's pool to every core, and keeps it: two simulated clients on two cores each
run a two-thread BLAS. A BLAS call large enough to wake the pool then waits for a helper thread the other client's
work has descheduled: on a busy 2-core machine ``np.linalg.norm`` of a 28,938-vector took 586 µs on average (tail
168 ms) with two threads against 6.7 µs with one. :func:`limit_to_allotment` resizes the pools (threadpoolctl) to
what ``OMP_NUM_THREADS`` says, once per process; a process without it (a SuperNode, a test) is left alone.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger(__name__)


@functools.cache
def limit_to_allotment() -> int | None:
    """Limit every BLAS and OpenMP pool of this process to ``OMP_NUM_THREADS`` threads; the limit applied, or None."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    try:
        threads = int(value)
    except ValueError:
        return None
    if threads < 1:
        return None
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads)
    log.debug("BLAS and OpenMP pools limited to OMP_NUM_THREADS = %d", threads)
    return threads
