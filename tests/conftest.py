"""Shared fixtures. Root-only tests skip with a reason for non-root users; .ci/run (root) turns skips of
root/lxc tests into failures with PVEGPU_REQUIRE_ROOT_TESTS=1."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PVEGPU_REQUIRE_ROOT_TESTS") == "1" and os.geteuid() != 0:
        raise pytest.UsageError("PVEGPU_REQUIRE_ROOT_TESTS=1 but not running as root")


def pytest_runtest_makereport(item, call):
    """Under PVEGPU_REQUIRE_ROOT_TESTS=1 a skipped root/lxc test is a failure, so CI always runs them."""
    if os.environ.get("PVEGPU_REQUIRE_ROOT_TESTS") != "1" or call.when != "setup":
        return None
    if (item.get_closest_marker("root") or item.get_closest_marker("lxc")) and call.excinfo is not None \
            and call.excinfo.errisinstance(pytest.skip.Exception):
        raise AssertionError(f"root test {item.nodeid} was skipped under CI: {call.excinfo.value}")
    return None
