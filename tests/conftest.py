"""Shared fixtures. Root-only tests (markers root, lxc) skip with a reason for non-root users;
with REQUIRE_ROOT_TESTS=1 (set by .ci/run, which runs as root) such a skip is a failure."""

from __future__ import annotations

import os

import pytest

from pvegpu.sim import scenario as sc


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if os.environ.get("REQUIRE_ROOT_TESTS") == "1" and rep.skipped \
            and (item.get_closest_marker("root") or item.get_closest_marker("lxc")):
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
