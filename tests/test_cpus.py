"""The cores a process may use (draftwise.cpus): its CPU affinity, capped by a container's cgroup CPU quota,
as --threads' default, a server replica's share and the load's spare-core test read it."""

from __future__ import annotations

import os

import pytest

from draftwise import cpus
from draftwise.api import setup_threads


def _tree(root, files: dict[str, str]):
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def _limit(tmp_path, cgroup: str, files: dict[str, str]):
    _tree(tmp_path / "fs", files)
    (tmp_path / "cgroup").write_text(cgroup)
    return cpus.cgroup_cpu_limit(tmp_path / "fs", tmp_path / "cgroup")


@pytest.mark.parametrize("cgroup,files,cores", [
    # cgroup v2: a container's own namespace (its cgroup is the mount's root)
    ("0::/\n", {"cpu.max": "200000 100000\n"}, 2.0),
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    # v2 on the host's hierarchy: the lowest quota on the way up counts (a pod's limit above a container's)
    ("0::/kubepods/pod1/c1\n", {"kubepods/pod1/c1/cpu.max": "max 100000\n",
                                "kubepods/pod1/cpu.max": "100000 100000\n", "cpu.max": "max 100000\n"}, 1.0),
    # v1: cpu,cpuacct mounted together; -1 is no quota
    ("4:cpu,cpuacct:/\n2:memory:/x\n", {"cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
                                         "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    # v1 inside a container: the path names the host's cgroup, the mount is the container's own root
    ("3:cpu,cpuacct:/docker/abc\n", {"cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
                                      "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 0.5),
    ("0::/\n", {}, None),  # no cpu controller files at all
    ("0::/\n", {"cpu.max": "garbage\n"}, None),
])
def test_cgroup_cpu_limit(tmp_path, cgroup, files, cores):
    assert _limit(tmp_path, cgroup, files) == cores


def test_no_cgroup_file_is_no_limit(tmp_path):
    assert cpus.cgroup_cpu_limit(tmp_path, tmp_path / "absent") is None


def test_usable_cores_is_the_affinity_capped_by_the_quota_rounded_up(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1.5)
    assert cpus.usable_cores() == 2
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    assert cpus.usable_cores() == 64
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 0.2)
    assert cpus.usable_cores() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 8.0)
    assert cpus.usable_cores() == 2


def test_threads_default_to_the_usable_cores(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(cpus, "usable_cores", lambda: 1)
    try:
        setup_threads(None)
        assert torch.get_num_threads() == 1
        setup_threads(3)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_this_machine():
    """On the machine the suite runs on: never more than the affinity, at least one."""
    n = cpus.usable_cores()
    assert 1 <= n <= (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())


def test_a_decoder_caps_torchs_threads_to_the_usable_cores(monkeypatch):
    """torch's default counts the affinity, not a CPU quota: the Python API lowers it (not where
    OMP_NUM_THREADS was set, nor below what the user set)."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(4)
        monkeypatch.setattr(cpus, "usable_cores", lambda: 1)
        assert cpus.cap_torch_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(cpus, "usable_cores", lambda: 8)
        assert cpus.cap_torch_threads() == 1  # never raised
        torch.set_num_threads(4)
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        monkeypatch.setattr(cpus, "usable_cores", lambda: 1)
        assert cpus.cap_torch_threads() == 4 and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_the_python_api_caps_them(hf_folder, monkeypatch):
    import torch

    from draftwise import SpeculativeDecoder

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "usable_cores", lambda: 1)
    try:
        torch.set_num_threads(2)
        SpeculativeDecoder(str(hf_folder), draft=None, progress=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
