"""The reset's only exit-code table (``reset.conclude``), row by row."""

from __future__ import annotations

import pytest

from pvegpu.core import errors as E
from pvegpu.core.holders import GpuFacts
from pvegpu.core.model import GpuInfo, GpuSample
from pvegpu.reset import ResetOutcome
from pvegpu.reset.conclude import conclude
from pvegpu.reset.results import Verified

GPU = GpuInfo(0, 0, "GPU-0", "0000:01:00.0")
READ = {0: GpuFacts(GPU, GpuSample(0, 1 << 30, []))}
UNREAD = {0: GpuFacts(GPU, GpuSample(0, None, None, "GPU is lost"))}
HELD = {0: GpuFacts(GPU, GpuSample(0, 1 << 30, []), unreadable=[4321])}


@pytest.mark.parametrize(("verdict", "facts", "kw", "outcome", "code"), [
    (None, READ, {"dry_run": True}, ResetOutcome.DRY_RUN, E.EXIT_OK),
    (Verified.CLEAN, READ, {}, ResetOutcome.CLEAN, E.EXIT_OK),
    (Verified.CLEAN, READ, {"left_stopped": True}, ResetOutcome.CLEAN_RESTART_FAILED, E.EXIT_PVE),
    (Verified.CLEAN, READ, {"pve_error": E.EXIT_NOT_FOUND}, ResetOutcome.CLEAN_RESTART_FAILED, E.EXIT_NOT_FOUND),
    (Verified.UNSETTLED, READ, {}, ResetOutcome.NOT_VERIFIED, E.EXIT_GPU_UNKNOWN),
    (Verified.UNSETTLED, READ, {"pve_error": E.EXIT_PVE}, ResetOutcome.NOT_VERIFIED, E.EXIT_PVE),
    (Verified.NOT_CLEAN, UNREAD, {}, ResetOutcome.NOT_CLEAN, E.EXIT_GPU_UNKNOWN),
    (Verified.NOT_CLEAN, HELD, {}, ResetOutcome.NOT_CLEAN, E.EXIT_HOLDERS_LEFT),
    (Verified.NOT_CLEAN, READ, {}, ResetOutcome.NOT_CLEAN, E.EXIT_MEMORY_LEFT),
    (Verified.NOT_CLEAN, READ, {"pve_error": E.EXIT_PVE}, ResetOutcome.NOT_CLEAN, E.EXIT_PVE),
    (None, {}, {}, ResetOutcome.NOT_CLEAN, E.EXIT_FAILURE),
    (Verified.CLEAN, READ, {"signal_exit": 143}, ResetOutcome.CLEAN, 143),
    (None, {}, {"signal_exit": 130}, ResetOutcome.NOT_CLEAN, 130),
])
def test_conclude_is_the_exit_code_table(verdict, facts, kw, outcome, code):
    """Each row of the table: the verdict, a failed restart step, a CT left stopped and a signal give this outcome and code."""
    c = conclude(verdict, facts, **kw)
    assert (c.outcome, c.exit_code) == (outcome, code)


def test_outcome_slugs_and_labels():
    """Each outcome has a slug for programs (the JSON's outcome_kind) and keeps its words as the human label."""
    assert {o.slug for o in ResetOutcome} == {"clean", "clean-restart-failed", "not-verified", "not-clean", "dry-run"}
    assert ResetOutcome.CLEAN_RESTART_FAILED.label == "clean, but the restart failed" == ResetOutcome.CLEAN_RESTART_FAILED.value
