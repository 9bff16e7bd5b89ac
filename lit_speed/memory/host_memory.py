"""The host memory this process can use: the smaller of its cgroup's limit and the machine's memory.

In a container (Docker, Kubernetes, a CI runner, a SLURM job with a memory cgroup) ``/proc/meminfo`` and
``psutil.virtual_memory()`` describe the whole machine, while the kernel stops the process at its cgroup's limit. The
fit check, the planner, the bottleneck verdict, the start-up table and the freed-memory policy all ask
:func:`host_memory`, so they agree on one number:

- ``total``: ``min(cgroup limit, MemTotal)`` -- v2 ``memory.max``, v1 ``memory.limit_in_bytes``, the lowest limit
  on the way from the process's cgroup up to the root (a parent's limit binds its children too);
- ``available``: ``min(MemAvailable, limit - usage)``, usage without the cgroup's inactive file cache (the kernel
  reclaims that before it stops anything; what ``docker stats`` counts).

A limit of ``max`` (v2) or the page-rounded ``2**63 - 1`` (v1) means none.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: v1 writes "no limit" as a page-rounded 2**63 - 1; anything at or above this is no limit
_NO_LIMIT = 2**60

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CgroupMemory:
    """The binding memory limit of this process's cgroup and the cgroup's usage (bytes; inactive file cache out)."""

    limit: int
    usage: int | None
    source: str  # the file the limit was read from


@dataclass(frozen=True)
class HostMemory:
    """What this process can use of the host's memory (bytes).

    Attributes:
        total: ``min(cgroup limit, MemTotal)``.
        available: What it can still get now: ``min(MemAvailable, cgroup limit - cgroup usage)``.
        source: Where ``total`` comes from (``MemTotal``, or the cgroup file), for the start-up table.
    """

    total: int
    available: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value < _NO_LIMIT else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _own_paths(self_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup paths: the v2 one (``0::/path``) and the v1 memory controller's (``N:memory:/path``)."""
    v2 = v1 = None
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _candidates(mount: Path, path: str | None) -> list[Path]:
    """The cgroup folders from the process's own up to the mount point (as seen inside a container the mount is often
    the process's cgroup itself, and the path from ``/proc/self/cgroup`` does not exist below it)."""
    folders = []
    if path:
        folder = mount / path.strip("/")
        while True:
            folders.append(folder)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    if mount not in folders:
        folders.append(mount)
    return [f for f in dict.fromkeys(folders) if f.is_dir()]


def cgroup_memory(root: Path | None = None, self_cgroup: Path | None = None) -> CgroupMemory | None:
    """The lowest memory limit on this process's cgroup path (v2 ``memory.max``, else v1 ``memory.limit_in_bytes``)
    and its cgroup's usage; ``None`` where no limit applies (or there is no cgroup file system: not Linux).

    Args:
        root: The cgroup file system's mount (default :data:`CGROUP_ROOT`).
        self_cgroup: This process's cgroup membership file (default :data:`SELF_CGROUP`).
    """
    root = CGROUP_ROOT if root is None else root
    v2_path, v1_path = _own_paths(SELF_CGROUP if self_cgroup is None else self_cgroup)
    for mount, path, limit_file, usage_file, inactive_key in (
            (root, v2_path, "memory.max", "memory.current", "inactive_file"),
            (root / "memory", v1_path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        if path is None and not (mount / limit_file).is_file():
            continue
        found: CgroupMemory | None = None
        for folder in _candidates(mount, path):
            limit = _read_int(folder / limit_file)
            if limit is None or (found is not None and limit >= found.limit):
                continue
            usage = _read_int(folder / usage_file)
            if usage is not None:
                usage = max(usage - _stat(folder / "memory.stat", inactive_key), 0)
            found = CgroupMemory(limit, usage, str(folder / limit_file))
        if found is not None:
            return found
    return None


def host_memory() -> HostMemory:
    """What this process can use of the host's memory now (see the module docstring). The one place that reads it."""
    import psutil

    machine = psutil.virtual_memory()
    cgroup = cgroup_memory()
    if cgroup is None or cgroup.limit >= machine.total:
        return HostMemory(int(machine.total), int(machine.available), "MemTotal")
    left = cgroup.limit - cgroup.usage if cgroup.usage is not None else cgroup.limit
    return HostMemory(int(cgroup.limit), int(max(min(machine.available, left), 0)), f"cgroup limit {cgroup.source}")


def describe(memory: HostMemory) -> str:
    """``"23.5 GiB (MemTotal), 21.0 GiB available"``: the start-up table's row."""
    return f"{memory.total / 2**30:.1f} GiB ({memory.source}), {memory.available / 2**30:.1f} GiB available"
