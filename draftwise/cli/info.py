"""``draftwise info``: what a bug report needs."""

from __future__ import annotations

import argparse
import json

HELP = "version, CPU features, the kernel path chosen and whether the kernel built"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    """Versions, the CPU's features, the kernel path in use (DRAFTWISE_ISA forces a lower one), whether the
    kernel built (the first call builds it: ~1-2 min once)."""
    import platform

    import torch

    from .. import __version__
    from ..cpus import affinity_cores, cgroup_cpu_limit, usable_cores
    from ..kernels import kernel_info

    # threads: what the other commands run on without --threads (the CPU affinity, capped by a cgroup quota)
    info = {"draftwise": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "threads": usable_cores(), "cpu_affinity": affinity_cores(), "cpu_quota": cgroup_cpu_limit(),
            **kernel_info()}
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {' '.join(v) if isinstance(v, list) else v}")
    return 0
