"""A pod's CPU limit read from fake cgroup trees (v2 and v1, in and out of a cgroup namespace),
and the torch threads it allows."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.services.cpu_quota import cpu_quota, quota_threads


def _tree(tmp: Path, files: dict[str, str], self_cgroup: str) -> tuple[Path, Path]:
    root = tmp / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    (tmp / "self").write_text(self_cgroup + "\n")
    return root, tmp / "self"


@pytest.mark.parametrize(
    "files, self_cgroup, expected",
    [
        # v2 in a container with its own cgroup namespace: "0::/", the limit at the root.
        ({"cpu.max": "200000 100000"}, "0::/", 2.0),
        ({"cpu.max": "max 100000"}, "0::/", None),
        ({"cpu.max": "50000 100000"}, "0::/", 0.5),
        # v2 seen from the host: the container's cgroup under the pod's; the smaller limit applies.
        (
            {
                "kubepods/pod1/cpu.max": "150000 100000",
                "kubepods/pod1/c1/cpu.max": "max 100000",
                "kubepods/cpu.max": "max 100000",
            },
            "0::/kubepods/pod1/c1",
            1.5,
        ),
        (
            {"kubepods/pod1/cpu.max": "400000 100000", "kubepods/pod1/c1/cpu.max": "300000 100000"},
            "0::/kubepods/pod1/c1",
            3.0,
        ),
        # v1: the cpu controller's own mount; -1 is no quota.
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "250000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            "12:cpu,cpuacct:/\n3:memory:/",
            2.5,
        ),
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            "12:cpu,cpuacct:/",
            None,
        ),
        # v1 in a container without a cgroup namespace: the host's path is not under the mount,
        # which is the container's own cgroup.
        (
            {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"},
            "4:cpu:/kubepods/burstable/pod1/c1",
            1.0,
        ),
        # Nothing mounted.
        ({}, "0::/", None),
    ],
)
def test_the_quota_is_the_smallest_limit_over_the_cgroup_and_its_parents(
    tmp_path, files, self_cgroup, expected
):
    root, self_file = _tree(tmp_path, files, self_cgroup)
    assert cpu_quota(root, self_file) == expected


def test_without_proc_self_cgroup_the_root_is_read(tmp_path):
    root, _ = _tree(tmp_path, {"cpu.max": "300000 100000"}, "")
    assert cpu_quota(root, tmp_path / "missing") == 3.0


@pytest.mark.parametrize(
    "quota, available, threads",
    [(None, 8, 8), (2.0, 64, 2), (2.5, 64, 2), (0.5, 8, 1), (16.0, 4, 4), (3.0, 3, 3), (0.3 * 10, 8, 3)],
)
def test_threads_are_the_quota_rounded_down_within_the_cores(quota, available, threads):
    assert quota_threads(quota, available) == threads
