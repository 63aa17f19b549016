"""Review round 10: attacks on ce3fae0 (describe stalls keep the holding, bounded cmdline reads, map_files stat checked
against the maps key, second-look descriptions): a deep scan whose maps read stalls keeps what the fds proved; on
btrfs the key check leaves mapped files uncached (a known gap: slower, never wrong)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from pvegpu.adapters import devscan
from pvegpu.adapters.procfs import ProcHost
from tests.test_scan_ahead import _table

_MAPPER = r"""
import mmap, sys, time
f = open(sys.argv[1], 'rb')
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print('ok', flush=True)
time.sleep(60)
"""


@pytest.fixture
def btrfs_dir():
    """A directory on a loop-mounted btrfs (root and btrfs-progs needed, else skipped)."""
    if os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None:
        pytest.skip("needs root and mkfs.btrfs")
    base = tempfile.mkdtemp()
    img, mnt = os.path.join(base, "img"), os.path.join(base, "mnt")
    os.mkdir(mnt)
    with open(img, "wb") as f:
        f.truncate(200 << 20)
    if subprocess.run(["mkfs.btrfs", "-q", img], capture_output=True).returncode != 0 or \
            subprocess.run(["mount", "-o", "loop", img, mnt], capture_output=True).returncode != 0:
        shutil.rmtree(base)
        pytest.skip("cannot make or mount a btrfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", mnt], capture_output=True)
        shutil.rmtree(base)


@pytest.mark.xfail(strict=True, reason="known gap (closing note): on btrfs maps prints the superblock's device, stat the "
                   "subvolume's, so no mapped file is cached: slower (one statx per file per process), never wrong")
def test_a_btrfs_mapped_file_is_stated_once_per_scan(btrfs_dir, monkeypatch):
    """A file on btrfs mapped by two processes is stat'ed through map_files once per scan (the cache): maps prints the
    superblock's device (i_sb->s_dev) but stat gives the subvolume's, so the key check must not call every btrfs file
    (a PVE root on btrfs, a btrfs storage's CT subvolumes) "remapped" and disable the scan's cache for all of them."""
    path = os.path.join(btrfs_dir, "lib.so")
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    calls: list[str] = []
    named = devscan.StatNosync.named

    def counting(self, p, key):
        if os.readlink(p) == path:
            calls.append(p)
        return named(self, p, key)

    monkeypatch.setattr(devscan.StatNosync, "named", counting)
    ps = [subprocess.Popen([sys.executable, "-c", _MAPPER, path], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for p in ps:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
        got = ProcHost(_table(), workers=1).holdings([p.pid for p in ps])
        assert not got, got
        assert len(calls) == 1, calls
    finally:
        for p in ps:
            p.kill()
            p.wait()


def test_a_gpu_fd_holder_whose_maps_read_stalls_keeps_its_gpu_in_a_deep_scan(tmp_path):
    """A holder proven by its GPU fd whose maps read then blocks (mm lock wedged by the tenant: a FIFO here) keeps GPU 0
    in a deep (audit) scan, as round 9 made a stalled description keep it: "unreadable, no GPU" shows nowhere in the audit."""
    pid = 8200
    d = tmp_path / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_bytes(b"%d (job) S 1 0 0 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123 0 0 0\n" % pid)
    (d / "fd" / "3").symlink_to("/dev/full")
    fifo = str(d / "maps")
    os.mkfifo(fifo)
    try:
        assert ProcHost(_table(), proc=str(tmp_path), workers=1).holdings([pid])[pid].minors == {0}  # not deep: proven
        got = ProcHost(_table(), proc=str(tmp_path), workers=1).holdings([pid], deep=True)
        assert 0 in got[pid].minors, got[pid]
    finally:
        for _ in range(3):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
