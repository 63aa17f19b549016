"""Shared fixtures. Root-only tests (markers root, lxc, map_files) skip with a reason for non-root users;
with REQUIRE_ROOT_TESTS=1 (set by .ci/run for its run as root) such a skip is a failure."""

from __future__ import annotations

import os

import pytest

from pvegpu.sim import scenario as sc

ROOT_MARKERS = ("root", "lxc", "map_files")


def map_files_readable() -> bool:
    """Can this process stat its own ``/proc/self/map_files/<range>``? The kernel allows it only with
    CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE), so not as a user, even for the user's own processes."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            rng = next(line.split()[0] for line in f if len(line.split()) >= 6 and line.split()[4] != "0")
        os.stat(f"/proc/self/map_files/{rng}")
    except (OSError, StopIteration):
        return False
    return True


def pytest_runtest_setup(item):
    root = item.get_closest_marker("root")
    if root and os.geteuid() != 0:
        pytest.skip(root.kwargs.get("reason", "needs root: it reads or changes what only root may (every process's /proc, "
                                              "the root-only settings snapshot)"))
    if item.get_closest_marker("map_files") and not map_files_readable():
        pytest.skip("needs root: the real /proc adapter proves a mapping by stat of /proc/<pid>/map_files, "
                    "which the kernel allows only with CAP_SYS_ADMIN")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("REQUIRE_ROOT_TESTS") == "1" and rep.skipped and not hasattr(rep, "wasxfail") \
            and any(item.get_closest_marker(m) for m in ROOT_MARKERS):  # an expected failure (xfail) ran: not a skip
        rep.outcome = "failed"
        rep.longrepr = f"root-only test skipped under REQUIRE_ROOT_TESTS=1: {rep.longrepr}"


@pytest.fixture
def sim_node():
    """Build a simulated node from a scenario dict; torn down (processes killed) after the test."""
    nodes = []

    def make(scenario):
        node = sc.build(scenario)
        nodes.append(node)
        return node

    yield make
    for n in nodes:
        n.teardown()
