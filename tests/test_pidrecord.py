"""The record of NVML-listed pids kept between runs (``adapters/pidrecord.py``): a root-only directory, a mode 600
file, ignored when anyone else could have written it or it is of another boot, bounded to the pids NVML lists now."""

from __future__ import annotations

import os
import stat

import pytest

from pvegpu.adapters import pidrecord
from pvegpu.core.holders import seen_now
from pvegpu.core.model import GpuSample, NvmlProcess, Place, Placement, ProcIdentity, ProcInfo, SeenPid

REC = {4242: SeenPid(1000, Placement(Place.CONTAINER, 129)), 4243: SeenPid(None, None, 5000), 4244: SeenPid(7, Placement(Place.HOST))}


def test_the_record_reads_back_what_was_written_in_a_root_only_directory(tmp_path):
    """Written into a directory it creates with mode 700, as a mode 600 file; read back equal (same boot)."""
    d = str(tmp_path / "pids")
    pidrecord.write(d, REC, boot="b1")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(d, pidrecord.NAME)).st_mode) == 0o600
    assert pidrecord.read(d, boot="b1") == REC


def test_no_record_reads_as_none(tmp_path):
    """A fresh node (no directory, no file) has no record: nothing is known of earlier runs."""
    assert pidrecord.read(str(tmp_path / "pids"), boot="b1") is None
    os.mkdir(tmp_path / "pids", 0o700)
    assert pidrecord.read(str(tmp_path / "pids"), boot="b1") is None


def test_a_record_of_another_boot_is_ignored(tmp_path):
    """Start times count from boot: a record written before a reboot is no evidence."""
    d = str(tmp_path / "pids")
    pidrecord.write(d, REC, boot="b1")
    assert pidrecord.read(d, boot="b2") is None


@pytest.mark.parametrize("how", ["file-mode", "dir-mode", "owner", "garbage", "link"])
def test_a_record_anyone_else_could_have_written_is_ignored(tmp_path, how):
    """A file open to group/others, a directory open to them, a file of another owner, a file that is no record or a
    symlink planted at its name is not trusted: read as no record."""
    d = str(tmp_path / "pids")
    pidrecord.write(d, REC, boot="b1")
    path = os.path.join(d, pidrecord.NAME)
    if how == "file-mode":
        os.chmod(path, 0o644)
    elif how == "dir-mode":
        os.chmod(d, 0o755)
    elif how == "owner":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file away")
        os.chown(path, 65534, 65534)
    elif how == "garbage":
        with open(path, "w") as f:
            f.write('{"boot": "b1", "pids": {"1": {"start": "x"}}}')
    else:
        os.rename(path, str(tmp_path / "elsewhere"))
        os.symlink(str(tmp_path / "elsewhere"), path)
    assert pidrecord.read(d, boot="b1") is None


def test_a_record_that_cannot_be_written_is_no_error(tmp_path):
    """A directory that fails its check (open to others) is left alone: nothing written, nothing raised."""
    d = tmp_path / "pids"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    pidrecord.write(str(d), REC, boot="b1")
    assert not os.listdir(d)


def test_the_record_is_bounded(tmp_path, monkeypatch):
    """At most ``MAX_PIDS`` pids are written and read; a file larger than ``MAX_BYTES`` is not read."""
    monkeypatch.setattr(pidrecord, "MAX_PIDS", 2)
    d = str(tmp_path / "pids")
    pidrecord.write(d, REC, boot="b1")
    assert len(pidrecord.read(d, boot="b1") or {}) == 2
    monkeypatch.setattr(pidrecord, "MAX_BYTES", 10)
    assert pidrecord.read(d, boot="b1") is None


def _info(pid: int, start: int, vmid: int) -> ProcInfo:
    return ProcInfo(ProcIdentity(pid, start), "job", "S", Placement(Place.CONTAINER, vmid), f"/lxc/{vmid}/ns", 2)


def test_the_record_keeps_only_the_pids_listed_now():
    """A complete reading drops the pids it no longer lists; a listed live pid is recorded with its start and
    container, a dead one keeps what was seen of it and when it was first seen dead; an incomplete reading drops none."""
    before = {1: SeenPid(10, Placement(Place.CONTAINER, 129)), 2: SeenPid(20, Placement(Place.CONTAINER, 130)),
              3: SeenPid(30, Placement(Place.CONTAINER, 131))}
    samples = {0: GpuSample(0, 1, (NvmlProcess(1, 1), NvmlProcess(4, 1)))}
    infos = {4: _info(4, 40, 132)}
    after = seen_now(before, samples, {}, infos.get, 99)
    assert after == {1: SeenPid(10, Placement(Place.CONTAINER, 129), 99), 4: SeenPid(40, Placement(Place.CONTAINER, 132))}
    again = seen_now(after, samples, {}, infos.get, 150)
    assert again[1].dead_since == 99  # first seen dead, not last
    partial = seen_now(before, {**samples, 1: GpuSample(1, None, None, "no reading")}, {}, infos.get, 99)
    assert set(partial) == {1, 2, 3, 4}
