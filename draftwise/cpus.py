"""The cores this process may use: what ``--threads`` defaults to (``api.setup_threads``), a server replica's
share (``serve --replicas``), whether a spare core is there for a side job (the tokenizer's parse at load).

``os.cpu_count()`` counts the host's cores. In a container it is often far more than the process may run on:
a cpuset (``docker --cpuset-cpus``, ``taskset``) narrows the CPU affinity, and a CPU quota (``docker --cpus 2``,
a Kubernetes CPU limit) lets the process run only so many cores' worth of time per period. The kernel's
threads (``kernels/csrc/core/pool.h``) meet at a barrier per matmul: with more threads than the quota, the
process is throttled for the rest of each 100 ms period once its threads have spent it, and every barrier
waits on a thread that is not running. So the default is the affinity's count, capped by the quota rounded up
(cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, the lowest on the way from the
process's cgroup to the root), as Go's runtime and the JVM do.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
log = logging.getLogger("draftwise")


def usable_cores() -> int:
    """The cores this process may run on at once: its CPU affinity's count, capped by a cgroup CPU quota
    (rounded up); at least 1."""
    cores = affinity_cores()
    quota = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(quota)) if quota is not None else cores)


def affinity_cores() -> int:
    """The cores in this process's CPU affinity (a cpuset, ``taskset``); ``os.cpu_count()`` where it cannot be read."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cap_torch_threads() -> int:
    """Lower torch's thread count (which the kernel's threads follow) to ``usable_cores`` where it is above, unless
    ``OMP_NUM_THREADS`` says otherwise: torch's default counts the CPU affinity but not a container's CPU quota.
    The Python API calls it when a ``SpeculativeDecoder`` is made (the commands set ``--threads``). Returns the
    thread count."""
    import torch

    from .settings import omp_num_threads_set

    n, usable = torch.get_num_threads(), usable_cores()
    if n > usable and not omp_num_threads_set():
        log.info("torch threads %d -> %d: the cores this process may use (CPU affinity, cgroup CPU quota)", n, usable)
        torch.set_num_threads(usable)
        return usable
    return n


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, cgroup_file: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroups in cores (quota / period; the lowest of its cgroup and its
    ancestors, cgroup v2 or v1), None where there is none or it cannot be read."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: "0::/path"
            limits += _walk(root, path, lambda d: _v2_limit(d / "cpu.max"))
        elif "cpu" in controllers.split(","):  # cgroup v1: "4:cpu,cpuacct:/path", mounted at cpu or cpu,cpuacct
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                if mount.is_dir():
                    limits += _walk(mount, path, lambda d: _v1_limit(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
                    break
    return min(limits) if limits else None


def _walk(mount: Path, path: str, read) -> list[float]:
    """``read`` at the cgroup ``path`` under ``mount`` and each of its ancestors up to ``mount`` (inside a
    container the process's path may name the host's hierarchy while ``mount`` is the container's own root:
    levels that do not exist are skipped)."""
    found = []
    rel = Path(path.strip().lstrip("/"))
    for d in [mount / rel, *[mount / p for p in rel.parents]]:
        v = read(d)
        if v is not None:
            found.append(v)
    return found


def _v2_limit(f: Path) -> float | None:
    try:
        quota, period = f.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_limit(quota_file: Path, period_file: Path) -> float | None:
    try:
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None
