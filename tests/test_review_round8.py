"""Review round 8: prerm's bound on reading /etc/pve; readings of a reset whose target pid was reused."""

from __future__ import annotations

import shutil
import time

from tests.test_packaging import _prerm


def test_prerm_is_bounded_when_the_hung_reader_survives_timeouts_kill(tmp_path):
    """A reader of /etc/pve stuck in the kernel (pmxcfs hung: D state, SIGKILL cannot end it) keeps the command
    substitution's pipe open: prerm must still end within the 10 s bound (stand-in: a holder outside timeout's group)."""
    local = tmp_path / "pve" / "nodes" / "pve1"
    (local / "lxc").mkdir(parents=True)
    (tmp_path / "pve" / "local").symlink_to(local)
    (local / "lxc" / "129.conf").write_text("hookscript: local:snippets/pvegpu-guard\n")
    tools = tmp_path / "bin"
    tools.mkdir()
    # the inner `sh -c "$scan"` is this stand-in: what it leaves holding stdout outlives timeout's TERM and KILL,
    # as the inner shell itself does when its stat/readdir of /etc/pve is stuck in uninterruptible sleep
    (tools / "sh").write_text(f"#!/bin/sh\n{shutil.which('setsid')} {shutil.which('sleep')} 15 &\nexec {shutil.which('sleep')} 15\n")
    (tools / "sh").chmod(0o755)
    t = time.monotonic()
    p = _prerm(tmp_path, tmp_path / "pve")
    took = time.monotonic() - t
    assert p.returncode == 0 and took < 10, (took, p.stderr)
    assert "not known" in p.stderr


def test_a_target_pid_reused_by_a_neighbours_gpu_job_is_never_the_targets_leftover():
    """The target's listed pid dies, its context is released (a reading sees the pid leave NVML's list), and a
    neighbour's new GPU job gets the pid: its listing is a new one, so its memory counts as the neighbour's, never as
    a ghost of the target that keeps it unclean and makes the reset restart it."""
    from pvegpu.core.holders import inspect_gpus
    from pvegpu.core.leftover import LeftoverRule, baseline
    from pvegpu.reset.diagnosis import restart_would_not_help
    from pvegpu.reset.verify import is_clean
    from tests.test_scan_ahead import target_job

    clock, host, probe, job, gpu, first, f0 = target_job()
    f0.baseline_bytes = baseline(f0, LeftoverRule())
    del host.procs[job.pid]  # stopped by the reset
    probe.model.sample([0])  # seen dead: the release latency runs
    clock.sleep(1.0)  # the driver released its context
    gone = inspect_gpus(129, gpu, host=host, probe=probe, first=first)[0]  # the verify loop's reading: no longer listed
    assert not gone.sample.processes
    neighbour = host.add(300, minors={0}, maps=True)  # a neighbour's new job ...
    del host.procs[neighbour.pid]
    neighbour.pid = job.pid  # ... got the freed pid
    host.procs[job.pid] = neighbour
    probe.context(0, 2048, neighbour)
    for whole in (False, True):  # the verify loop's readings and may_restart's whole-node reading
        f = inspect_gpus(129, gpu, host=host, probe=probe, first=first, whole_host=whole)[0]
        f.baseline_bytes = f0.baseline_bytes
        assert job.pid not in f.target_ghosts, f
        assert is_clean(f, 64) and restart_would_not_help({0: f}) is not None
