"""A per-user, per-machine cache shared by every process of a run (server, Ray actors, SuperNodes).

Start-up cost of a federation is dominated by work every process repeats: decoding a dataset and
calibrating each client's noise with the accountant. This cache keeps both across processes and runs:

* **datasets** — decoded, normalized arrays as ``.npy`` files, opened memory-mapped copy-on-write,
  so every process of a simulation shares one copy in the page cache (memory) and none decodes
  the source files again (time). Keyed by the source files' names, sizes and modification times.
* **calibrations** — the noise multiplier found for a (ε, δ, q, steps, accountant) target. A
  cached value is only a *starting point*: the caller re-checks it with the accountant before
  using it (:func:`fedapp.clients.dpsgd` does), so a stale or tampered cache can cost utility,
  never privacy.
* **grad-sample modes** — the fastest Opacus mode measured for a model, batch and device
  (:mod:`fedapp.clients.grad_sample_mode`).

Location: ``$DPFL_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpfl-flower``, else ``~/.cache/dpfl-flower``;
``DPFL_CACHE_DIR=off`` disables it. Every write goes to a temporary file that is renamed into
place, so a reader never sees a half-written entry and concurrent writers cannot corrupt one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where arrays are handled: the launcher reads this cache without it
    import numpy as np

DISABLED = "off"


def cache_dir() -> Path | None:
    """The cache folder (created on demand), or None when disabled or not writable."""
    env = os.environ.get("DPFL_CACHE_DIR", "")
    if env == DISABLED:
        return None
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dpfl-flower"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return base if os.access(base, os.W_OK) else None


@functools.cache
def library_versions(*packages: str) -> str:
    """``name=version`` of each installed package (``-`` when absent): part of a cache key whenever those
    packages produce what is cached, so an upgrade rebuilds it instead of reusing another version's output."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in packages:
        try:
            out.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            out.append(f"{name}=-")
    return ",".join(out)


def fingerprint(files: Iterable[Path], *extra: object) -> str:
    """A short hash of the files' resolved paths, sizes and mtimes plus ``extra`` (e.g. a format version)."""
    h = hashlib.sha256()
    for f in sorted(Path(p).resolve() for p in files):
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(repr(extra).encode())
    return h.hexdigest()[:20]


def _atomic_write(path: Path, write: Callable[[str], object]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cached_arrays(key: str, build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays ``build()`` returns, memory-mapped from the cache when present (built and stored once).

    Arrays come back copy-on-write (writable, shared until written). Without a cache, ``build()``."""
    import numpy as np

    base = cache_dir()
    if base is None:
        return build()
    folder = base / "datasets" / key
    done = folder / "complete.json"
    if done.is_file():
        try:
            names = json.loads(done.read_text())["arrays"]
            return {n: np.load(folder / f"{n}.npy", mmap_mode="c") for n in names}
        except (OSError, ValueError, KeyError):
            pass  # unreadable entry: rebuild it
    arrays = build()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name, arr in arrays.items():
            _atomic_write(folder / f"{name}.npy", functools.partial(_save_npy, arr=arr))
        _atomic_write(done, lambda tmp: Path(tmp).write_text(json.dumps({"arrays": sorted(arrays)})))
    except OSError:
        return arrays
    return {n: np.load(folder / f"{n}.npy", mmap_mode="c") for n in arrays}


def release_mapped_pages(*arrays: np.ndarray) -> None:
    """Unmap the pages of memory-mapped cache arrays that this process has read (``madvise(MADV_DONTNEED)``).

    A copy-on-write mapping keeps every page a process has touched mapped into it for as long as the array
    lives: an actor that trained every client of a run ends up mapping the whole training pool (188 MB for
    MNIST), in every actor. After a client's rows are copied out the pool's pages are not needed by this
    process; dropped, they stay in the kernel's page cache (shared, reclaimable; the next client's rows come
    back from it without a disk read) instead of the actor's resident set.

    Dropping a written copy-on-write page would discard the write, so only read-only arrays are released
    (:func:`fedapp.data.datasets.load_dataset` hands out read-only pools); writable or not memory-mapped arrays are
    left alone."""
    import mmap

    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    for arr in arrays:
        mapping = getattr(arr, "_mmap", None)
        if not arr.flags.writeable and isinstance(mapping, mmap.mmap) and not mapping.closed:
            mapping.madvise(mmap.MADV_DONTNEED)


def read_rows(arr: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``arr[idx]`` (a new array) for 1-d integer ``idx``; from a read-only memory-mapped cache array, read from
    its file with ``pread`` instead of through the mapping.

    Indexing a mapped pool faults each row's page into this process, and the kernel maps the cached pages around
    every fault as well (fault-around, 64 KB): gathering one client's 3,000 MNIST rows mapped most of the 188 MB
    pool into the actor until :func:`release_mapped_pages` dropped it again — a transient +100-150 MB of the
    actor's PSS in every round, which the summed-memory peak of a run caught whenever two such moments met.
    Reading the rows from the page cache with ``pread`` copies the same bytes and maps nothing. Consecutive
    indices are read with one call; rows whose span in the file is at most :data:`SPAN_READ_FACTOR` times what they
    hold (or at most :data:`SPAN_READ_BYTES`: a pool's labels) are read with one call for the whole span and picked
    out of it (3,000 labels of MNIST's 60,000: 4.3 ms as 3,000 reads, 0.2 ms as one). Writable arrays (a
    copy-on-write page may differ from the file), non-contiguous ones and anything not memory-mapped are indexed
    as usual."""
    import mmap

    import numpy as np

    idx = np.asarray(idx)
    mapping, filename = getattr(arr, "_mmap", None), getattr(arr, "filename", None)
    if (not isinstance(mapping, mmap.mmap) or mapping.closed or not filename or arr.flags.writeable
            or not arr.flags.c_contiguous or arr.ndim == 0 or idx.ndim != 1 or idx.dtype.kind not in "iu"
            or len(idx) == 0):
        return arr[idx]
    n = len(arr)
    if idx.min() < -n or idx.max() >= n:
        return arr[idx]  # numpy's IndexError
    idx = np.where(idx < 0, idx + n, idx).astype(np.int64)
    view = np.frombuffer(mapping, dtype=np.uint8)
    first_byte = arr.__array_interface__["data"][0] - view.__array_interface__["data"][0]
    del view  # releases the mapping's buffer export
    offset = int(getattr(arr, "offset", 0))  # np.memmap's: where its array starts in the file
    file_start = offset - offset % mmap.ALLOCATIONGRANULARITY + first_byte  # the mapping starts on a granularity boundary
    row = arr.strides[0]
    low, high = int(idx.min()), int(idx.max()) + 1
    span = (high - low) * row
    with open(filename, "rb", buffering=0) as fh:
        if span <= max(SPAN_READ_FACTOR * len(idx) * row, SPAN_READ_BYTES):
            block = np.empty((high - low, *arr.shape[1:]), dtype=arr.dtype)
            if os.preadv(fh.fileno(), [block.reshape(-1).view(np.uint8).data], file_start + low * row) != span:
                return arr[idx]  # a short read: the file is not what was mapped
            return block[idx - low]
        out = np.empty((len(idx), *arr.shape[1:]), dtype=arr.dtype)
        flat = out.reshape(-1).view(np.uint8).data
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        starts, ends = np.r_[0, breaks], np.r_[breaks, len(idx)]
        fd, preadv = fh.fileno(), os.preadv  # one call per run of consecutive rows; the loop is the cost
        for a, b, at in zip((starts * row).tolist(), (ends * row).tolist(), (file_start + idx[starts] * row).tolist()):
            if preadv(fd, [flat[a:b]], at) != b - a:
                return arr[idx]
    return out


#: :func:`read_rows` reads the whole span of the rows it wants, in one call, when the span is at most this many times
#: the bytes of those rows, or at most :data:`SPAN_READ_BYTES`
SPAN_READ_FACTOR = 4
SPAN_READ_BYTES = 1 << 20


def _save_npy(path: str, arr: np.ndarray) -> None:
    import numpy as np

    with open(path, "wb") as fh:
        np.save(fh, np.ascontiguousarray(arr), allow_pickle=False)


def _entry_path(base: Path, namespace: str, fields: dict[str, object]) -> Path:
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    return base / namespace / f"{key}.json"


def lookup(namespace: str, fields: dict[str, object]) -> object | None:
    """The value stored under exactly ``fields`` in ``namespace``, or None (absent, unreadable, disabled)."""
    base = cache_dir()
    if base is None:
        return None
    try:
        entry = json.loads(_entry_path(base, namespace, fields).read_text())
    except (OSError, ValueError):
        return None
    return entry.get("value") if isinstance(entry, dict) and entry.get("fields") == fields else None


def store(namespace: str, fields: dict[str, object], value: object) -> None:
    """Store a JSON-serializable ``value`` under ``fields`` (atomically; silently skipped when disabled)."""
    base = cache_dir()
    if base is None:
        return
    path = _entry_path(base, namespace, fields)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"fields": fields, "value": value})
        _atomic_write(path, lambda tmp: Path(tmp).write_text(payload))
    except OSError:
        pass


@contextlib.contextmanager
def entry_lock(namespace: str, fields: dict[str, object]) -> Iterator[None]:
    """Hold an exclusive lock on the entry under ``fields`` (``flock`` on a lock file beside it) while the caller
    looks it up and, if absent, computes and stores it: concurrent processes then compute it once and all use that
    value. No lock where the cache is disabled or the platform has no ``flock``."""
    base = cache_dir()
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        fcntl = None  # type: ignore[assignment]
    if base is None or fcntl is None:
        yield
        return
    path = _entry_path(base, namespace, fields).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 — held open for the lock's lifetime
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def calibrated_noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int, kind: str) -> float:
    """:func:`strategies.privacy.calibration.calibrate_noise_multiplier` through the shared cache.

    A cached z is used only when the accountant confirms that ``steps`` steps at (z, q) spend at most
    ``epsilon`` (one evaluation, whose per-(z, q) result the first round reuses anyway); otherwise z is
    calibrated afresh and stored."""
    from strategies.privacy.accountants import accountant_versions, epsilon_of
    from strategies.privacy.budget import exceeds_budget
    from strategies.privacy.calibration import calibrate_noise_multiplier

    fields = {"epsilon": float(epsilon), "delta": float(delta), "sample_rate": float(sample_rate),
              "steps": int(steps), "accountant": str(kind), "libraries": accountant_versions()}
    cached = lookup("calibrations", fields)
    z = float(cached) if isinstance(cached, (int, float)) and not isinstance(cached, bool) and cached > 0 else None
    if z is not None and not exceeds_budget(epsilon_of([(z, sample_rate, steps)], delta, kind), epsilon):
        return z
    z = calibrate_noise_multiplier(epsilon, delta, sample_rate, steps, kind=kind)
    store("calibrations", fields, z)
    return z


def calibrated_soteriafl_sigma(estimator: str, epsilon: float, delta: float, clip: float, batch_size: int, m: int,
                               rounds: int, accountant: str) -> tuple[float, float]:
    """:func:`strategies.soteriafl.calibrate_sigma` (σ_p and its SVRG/SAGA split) through the shared cache.

    The bisection costs tens of accountant evaluations (25 s for a 100-round SGD client of the a9a sweep,
    m = 2,930, b = 84); every SoteriaFL client of a run, and every run of a sweep, asks for the same value. A cached (σ_p, split) is used only
    when the accountant confirms, in one evaluation, that its noise history spends at most ``epsilon``;
    otherwise it is calibrated afresh and stored."""
    from strategies.privacy.accountants import accountant_versions, epsilon_of
    from strategies.privacy.budget import exceeds_budget
    from strategies.soteriafl import calibrate_sigma, noise_history

    fields = {"estimator": str(estimator), "epsilon": float(epsilon), "delta": float(delta), "clip": float(clip),
              "batch_size": int(batch_size), "m": int(m), "rounds": int(rounds), "accountant": str(accountant),
              "libraries": accountant_versions()}
    cached = lookup("soteriafl-sigma", fields)
    if (isinstance(cached, list) and len(cached) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in cached)
            and cached[0] > 0 and 0 < cached[1] <= 1):
        sigma, split = float(cached[0]), float(cached[1])
        spent = epsilon_of(noise_history(estimator, sigma, clip, batch_size, m, rounds, split), delta, accountant)
        if not exceeds_budget(spent, epsilon):
            return sigma, split
    sigma, split = calibrate_sigma(estimator, epsilon, delta, clip, batch_size, m, rounds, accountant)
    store("soteriafl-sigma", fields, [sigma, split])
    return sigma, split
