"""Where choices measured on this machine are kept, and what "this machine" means.

A choice whose best value depends on the hardware (a precision mode, an optimizer kernel, a thread count) is timed
where the run happens and cached per machine: the key holds the CPU model and its bf16/AVX/AMX flags (or the GPU
name), the thread count and the torch version, so the same command on another CPU decides afresh. The cache is a
folder of small JSON files, one per kind of choice: ``$LIT_SPEED_CACHE_DIR``, else ``$XDG_CACHE_HOME/lit_speed`` or
``~/.cache/lit_speed``. ``LIT_SPEED_AUTO_CACHE=0`` turns it off (every run times afresh and writes nothing).
:func:`measured_times` is that cache, the one of every measured choice (``precision=auto``'s step timings included):
an entry per key and machine, optionally timed again until it is settled, optionally kept in the process too.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (``model name``, ``cpu family``, ``flags``, ...); ``{}``
    where there is no such file (not Linux)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block describes the model
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def hardware(device: torch.device | None = None) -> str:
    """The CPU model and the flags that decide low-precision speed (or the CUDA device's name)."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = cpuinfo()
    flags = " ".join(f for f in info.get("flags", "").split() if "bf16" in f or f.startswith(("avx", "amx")))
    return f"{info.get('model name') or platform.processor()} [{flags}]"  # not Linux: the processor string


def machine_key(device: torch.device | None = None) -> dict[str, Any]:
    """The parts of a cache key that say which machine and software a timing ran on."""
    return {"hardware": hardware(device), "threads": torch.get_num_threads(), "torch": torch.__version__}


def disk_cache_enabled() -> bool:
    """``LIT_SPEED_AUTO_CACHE`` unset or true-ish."""
    return os.environ.get("LIT_SPEED_AUTO_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """The folder of the per-machine timing caches."""
    root = os.environ.get("LIT_SPEED_CACHE_DIR") or \
        os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lit_speed")
    return Path(root)


def read_json(path: Path) -> dict[str, Any]:
    """The cache file's entries; ``{}`` when it is missing or damaged (time afresh; the next write replaces it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_entry(path: Path, key: str, entry: dict[str, Any], what: str) -> None:
    """Add one entry, dated today; atomic (write a sibling, then rename) and never fatal: a cache is a shortcut.

    Args:
        path: The cache file.
        key: The entry's key (a JSON string of what the timing depends on).
        entry: What to keep (JSON-serialisable).
        what: The setting the cache serves, for the warning (e.g. ``"precision=auto"``).
    """
    try:
        data = read_json(path)
        data[key] = {**entry, "when": dt.date.today().isoformat()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as err:
        if path.parent in _UNWRITABLE:  # said once per folder and process: every timed choice would say it again
            return
        _UNWRITABLE.add(path.parent)
        warnings.warn(f"the timing cache {path.parent} cannot be written ({what}: {err.strerror or err}); the run "
                      "goes on, and choices timed in it are timed again in the next run. Fix: set LIT_SPEED_CACHE_DIR "
                      "to a writable folder, or LIT_SPEED_AUTO_CACHE=0.", stacklevel=3)


#: cache folders a write already failed in (this process): the warning is given once for each
_UNWRITABLE: set[Path] = set()


#: A timing during which other processes kept at least this many cores busy on average (CPU steal included) is used
#: by the run that took it and not cached: beside one busy core on a 2-core machine, a 2-thread step timed 1.3 s
#: against one thread's 0.08 s, and that answer must not stay the machine's once it is quiet again.
#: ``LIT_SPEED_BUSY_CORES`` overrides it (``inf``: cache however busy the machine is).
BUSY_CORES = 0.25
#: Timings shorter than this are not judged: the kernel's CPU counters tick every 10 ms, too coarse to tell.
BUSY_MIN_WALL_S = 0.5


class OtherLoad:
    """Cores that other processes kept busy, on average, while the ``with`` block ran: the machine's busy CPU time
    (``psutil.cpu_times``: all but idle and iowait, steal included) less this process's and its children's (data
    loader workers), over the wall time."""

    def __enter__(self) -> "OtherLoad":
        self._start = (time.perf_counter(), _machine_busy_s(), _own_cpu_s())
        self.cores = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        wall, busy, own = (now - then for now, then in zip((time.perf_counter(), _machine_busy_s(), _own_cpu_s()),
                                                            self._start))
        self.wall = wall
        self.cores = max(0.0, busy - own) / wall if wall > 0 else 0.0

    @property
    def busy(self) -> bool:
        """Whether the timing is not the quiet machine's (see :data:`BUSY_CORES`, :data:`BUSY_MIN_WALL_S`)."""
        limit = float(os.environ.get("LIT_SPEED_BUSY_CORES") or BUSY_CORES)
        return self.wall >= BUSY_MIN_WALL_S and self.cores >= limit


def _machine_busy_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _own_cpu_s() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            t = proc.cpu_times()
        except psutil.Error:  # a child that ended in between
            continue
        total += t.user + t.system
    return total


#: Timings kept in this process (full key -> entry) for the choices that ask for it (``in_process=True``).
_IN_PROCESS: dict[str, dict[str, Any]] = {}


def timing_key(key: Mapping[str, Any], device: Any = None) -> str:
    """The cache key of a timing: what it depends on (``key``) and the machine and software it ran on
    (:func:`~lit_speed.tuning.machine_cache.machine_key` of ``device``), as one JSON string."""
    return json.dumps({**machine_key(device), **dict(key)}, sort_keys=True, default=str)


def pool_samples(cached: Mapping[str, list[float] | None] | None, new: Mapping[str, list[float] | None]
                 ) -> dict[str, list[float] | None]:
    """The cached rounds and this run's, per candidate; a candidate that could not run in either stays ``None``."""
    if not cached:
        return dict(new)
    return {n: None if cached.get(n) is None or new[n] is None else [*cached[n], *new[n]]  # type: ignore[misc]
            for n in new}


def measured_times(path: Path, key: Mapping[str, Any], sample: Callable[[], Mapping[str, list[float] | None]],
                   what: str, device: Any = None, use_disk_cache: bool | None = None,
                   settled: Callable[[dict[str, Any]], bool] | None = None, in_process: bool = False
                   ) -> tuple[dict[str, float | None], str | None]:
    """The median seconds of each candidate for ``key`` on this machine, and the date they were cached on (``None``:
    timed in this process): the one cache of measured choices.

    The entry of :func:`timing_key` in the JSON file ``path`` is reused; else ``sample()`` times the candidates
    (seconds of each call per candidate, ``None`` for one that could not run) and their medians are written there.

    Args:
        path: The cache file (in :func:`~lit_speed.tuning.machine_cache.cache_dir`).
        key: What the timings depend on besides the machine, JSON-serialisable.
        sample: Times the candidates.
        what: The setting the timings serve, for the warning when the file cannot be written.
        device: The device the timings run on (its name is part of the key; ``None``: the CPU).
        use_disk_cache: Read and write ``path`` (default: unless ``LIT_SPEED_AUTO_CACHE=0``).
        settled: Given, the entry keeps its rounds, and an entry for which it is false is timed again with the new
            rounds pooled (:func:`pool_samples`): a decision made in a noisy second is not cached for good.
        in_process: Keep the entry in this process too: asked again, it answers the same without reading the file
            or timing, also with the disk cache off.
    """
    full = timing_key(key, device)
    if in_process and full in _IN_PROCESS:
        return dict(_IN_PROCESS[full]["times"]), _IN_PROCESS[full].get("when")
    use_disk = disk_cache_enabled() if use_disk_cache is None else use_disk_cache
    entry = read_json(path).get(full) if use_disk else None
    if entry is None or (settled is not None and not settled(entry)):
        with OtherLoad() as load:
            samples = dict(sample())
        kept: dict[str, Any] = {}
        if settled is not None:
            samples = pool_samples(entry.get("samples") if entry else None, samples)
            kept = {"samples": samples}
        entry = {**_store(path, full, samples, what, load, use_disk, kept), "when": None}
    if in_process:
        _IN_PROCESS[full] = entry
    return dict(entry["times"]), entry.get("when")


def cached_times(path: Path, key: Mapping[str, Any], device: Any = None, use_disk_cache: bool | None = None
                 ) -> tuple[dict[str, float | None], str] | None:
    """:func:`measured_times`' lookup alone: the cached medians for ``key`` and their date, or ``None`` (not cached,
    or the disk cache off). For a choice timed on the run's own steps, which cannot time on demand."""
    use_disk = disk_cache_enabled() if use_disk_cache is None else use_disk_cache
    entry = read_json(path).get(timing_key(key, device)) if use_disk else None
    return None if entry is None else (dict(entry["times"]), entry.get("when") or "")


def store_times(path: Path, key: Mapping[str, Any], samples: Mapping[str, list[float] | None], what: str,
                load: "OtherLoad", device: Any = None, use_disk_cache: bool | None = None) -> dict[str, float | None]:
    """:func:`measured_times`' store alone, for samples taken elsewhere (over the run's own steps, ``load`` measured
    around them): their medians, written to the cache unless the machine was busy (then said once)."""
    use_disk = disk_cache_enabled() if use_disk_cache is None else use_disk_cache
    return dict(_store(path, timing_key(key, device), dict(samples), what, load, use_disk, {})["times"])


def _store(path: Path, full: str, samples: dict[str, Any], what: str, load: "OtherLoad", use_disk: bool,
           kept: dict[str, Any]) -> dict[str, Any]:
    entry = {"times": {n: statistics.median(v) if v else None for n, v in samples.items()}, **kept}
    if use_disk and load.busy:
        _say_busy(what, load.cores)
    elif use_disk:
        write_entry(path, full, entry, what)
    return entry


def _say_busy(what: str, cores: float) -> None:
    """Say once per setting and process that a timing was not cached because the machine was busy."""
    if what in _SAID_BUSY:
        return
    _SAID_BUSY.add(what)
    warnings.warn(f"{what} was timed while other processes kept {cores:.1f} of {os.cpu_count()} cores busy: its choice "
                  "is used for this run and not cached, so the next run times it again (on a quiet machine the answer "
                  "can differ: fewer threads win beside a busy core).", stacklevel=4)


#: settings whose busy-machine timing was already said in this process
_SAID_BUSY: set[str] = set()
