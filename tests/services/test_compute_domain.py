"""A worker's compute domain: shared by the containers of one machine, its own under a CPU
quota (cgroup v1 and v2 layouts, built in a temporary folder)."""
from pathlib import Path

import pytest
import torch

from kvrelay.scheduler.core_share import domain_cpus
from kvrelay.worker import compute_domain as domains


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("cpu_max, capped", [("max 100000\n", False), ("200000 100000\n", True)])
def test_a_cgroup_v2_container_is_capped_by_its_cpu_max(tmp_path, cpu_max, capped):
    _write(tmp_path / "cgroup" / "cpu.max", cpu_max)
    _write(tmp_path / "self-cgroup", "0::/\n")
    assert domains.cpu_time_capped(tmp_path / "cgroup", tmp_path / "self-cgroup") is capped


@pytest.mark.parametrize("quota, capped", [("-1\n", False), ("50000\n", True)])
def test_a_cgroup_v1_process_is_capped_by_its_cfs_quota(tmp_path, quota, capped):
    _write(tmp_path / "cgroup" / "cpu,cpuacct" / "kubepods" / "pod-a" / "cpu.cfs_quota_us", quota)
    _write(tmp_path / "self-cgroup", "4:cpu,cpuacct:/kubepods/pod-a\n3:cpuset:/\n")
    assert domains.cpu_time_capped(tmp_path / "cgroup", tmp_path / "self-cgroup") is capped


def test_no_cgroup_files_means_no_cap(tmp_path):
    assert not domains.cpu_time_capped(tmp_path / "none", tmp_path / "missing")


def test_two_containers_of_one_machine_share_a_cpu_domain(monkeypatch):
    monkeypatch.setattr(domains, "cpu_time_capped", lambda: False)
    monkeypatch.setattr(domains.socket, "gethostname", lambda: "container-a")
    first = domains.compute_domain(torch.device("cpu"))
    monkeypatch.setattr(domains.socket, "gethostname", lambda: "container-b")
    assert domains.compute_domain(torch.device("cpu")) == first
    assert domain_cpus(first) == len(domains.os.sched_getaffinity(0))


def test_a_worker_under_a_cpu_quota_has_a_domain_of_its_own(monkeypatch):
    monkeypatch.setattr(domains, "cpu_time_capped", lambda: True)
    monkeypatch.setattr(domains.socket, "gethostname", lambda: "pod-a")
    first = domains.compute_domain(torch.device("cpu"))
    monkeypatch.setattr(domains.socket, "gethostname", lambda: "pod-b")
    assert domains.compute_domain(torch.device("cpu")) != first
    assert domain_cpus(first) == len(domains.os.sched_getaffinity(0))
