"""The audit round's scan changes give the scan before them's answers: ``maps`` lines of files the scan already knows
are no GPU are left out, fds are read through bytes paths, a gone process is found gone by its fd directory and its
maps (no existence check first). The reference is the scan as it was, kept here. A file is known to be no GPU only
when the file stat'ed is the (device, inode) its maps line named: a range mapped again in between proves nothing (on
btrfs, whose maps and stat give different devices, nothing is cached: a known gap, slower, never wrong)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pvegpu.adapters import devscan
from pvegpu.adapters.devscan import ProcessScan, maps_files
from pvegpu.adapters.procfs import DeviceTable, ProcHost
from tests.test_scan_ahead import _table
from tests.test_scan_parsers import _FIELD, ADVERSARIAL, _real_maps, _stat_text, old_maps


class OldScan(ProcessScan):
    """ProcessScan as it was before this round: text paths, an existence check, maps parsed without the cache."""

    def _fd_dirs(self, proc, pid, leader_zombie):
        base = f"{proc}/{pid}"
        if not leader_zombie:
            return [f"{base}/fd"] if os.path.exists(base) else None
        return super()._fd_dirs(proc, pid, leader_zombie)

    def _scan_fds(self, fd_dir, minors):
        found = False
        try:
            entries = os.scandir(fd_dir)
        except (FileNotFoundError, NotADirectoryError):
            return False
        with entries:
            for entry in entries:
                self._fds += 1
                if self._fds > self.budget.fds:
                    raise devscan._OverBudget
                try:
                    if not os.readlink(entry.path).startswith("/"):
                        continue
                    m = self.devices.of_mode(*self._stat(entry.path))
                except OSError:
                    continue
                if m is not None:
                    minors.add(m)
                    found = True
        return found

    def _scan_maps(self, proc, pid, leader_zombie, minors, via):
        real = devscan.maps_files
        devscan.maps_files = lambda lines, files, known=None, skip=None: real(lines, files)  # neither cache is consulted
        try:
            return super()._scan_maps(proc, pid, leader_zombie, minors, via)
        finally:
            devscan.maps_files = real


def _full() -> tuple[int, int]:
    rdev = os.stat("/dev/full").st_rdev
    return os.major(rdev), os.minor(rdev)


def _tree(tmp_path) -> str:
    """A /proc-like tree: fd holders, mappers proven through ``map_files`` (a link to the stand-in device), files
    mapped by many processes, unreadable maps, kernel threads, a pid whose directory is gone."""
    for i in range(80):
        pid = 7000 + i
        d = tmp_path / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "map_files").mkdir()
        (d / "stat").write_bytes(_stat_text(pid, 0x00208040 if i % 13 == 0 else 0x00400100))
        lines = [b"7f%02x0000-7f%02x1000 r--p 00000000 fd:01 %d /lib/x%d.so\n" % (i, i, 100 + i % 4, i % 4),
                 b"7f%02x2000-7f%02x3000 rw-s 00000000 00:05 %d /dev/nvidia0\n" % (i, i, 900 + i % 3) if i % 4 == 1 else b"",
                 b"7f%02x4000-7f%02x5000 rw-p 00000000 00:00 0 \n" % (i, i), *ADVERSARIAL[:3]]
        (d / "maps").write_bytes(b"".join(lines))
        (d / "map_files" / f"7f{i:02x}0000-7f{i:02x}1000").symlink_to("/dev/null")
        if i % 4 == 1 and i % 3 != 2:  # inode 900 + i % 3 is the stand-in GPU for 900 and 901, a plain file for 902
            (d / "map_files" / f"7f{i:02x}2000-7f{i:02x}3000").symlink_to("/dev/full")
        elif i % 4 == 1:
            (d / "map_files" / f"7f{i:02x}2000-7f{i:02x}3000").symlink_to("/etc/hostname")
        if i % 3 == 0:
            (d / "fd" / "3").symlink_to("/dev/full")
        if i % 5 == 0:
            (d / "fd" / "4").symlink_to("/dev/null")
            (d / "fd" / "5").symlink_to("pipe:[123]")
        if i % 7 == 0:
            (d / "maps").unlink()
            (d / "maps").mkdir()  # unreadable maps (EISDIR): unknown, never "holds nothing"
    return str(tmp_path)


def _scan(proc: str, scan: type[ProcessScan], pids: list[int] | None = None, deep: bool = False, **kw):
    return ProcHost(DeviceTable({_full(): 0}), proc=proc, workers=1, scan=scan, **kw).holdings(pids, deep=deep)


def test_maps_parse_with_the_scans_cache_leaves_out_only_files_known_to_be_no_gpu():
    """On every real maps text and the crafted lines: the files handed to the proof are the old parse's but those the
    cache knows are no GPU (a file it knows is a GPU is still handed on, so the holder is still found)."""
    texts = [*_real_maps(), b"".join(ADVERSARIAL[:-1])]
    for n, text in enumerate(texts):
        old = old_maps(text)
        known = {k: (None if i % 3 else 0) for i, k in enumerate(sorted(old)) if i % 2 == n % 2}
        lines = text.split(b"\n")
        lines.pop()
        files: dict[tuple[bytes, bytes], bytes] = {}
        maps_files(lines, files, known)
        assert files == {k: v for k, v in old.items() if known.get(k, 0) is not None}


def _in_one_scan(texts, known, skip):
    """maps_files over ``texts`` one after the other, as one scan reads its processes (``skip`` shared); each text's files."""
    out = []
    for text in texts:
        lines = text.split(b"\n")
        lines.pop()
        files: dict[tuple[bytes, bytes], bytes] = {}
        maps_files(lines, files, known, skip)
        out.append(files)
    return out


@pytest.mark.parametrize("room", [devscan.SKIP_TEXTS, 3])
def test_maps_lines_a_scan_skips_by_their_text_give_the_same_files(monkeypatch, room):
    """Every real maps text and the crafted lines, read in one scan twice over (the second pass skips most lines by
    their text after the address): the same files per text as the parse without the skipped texts, a file known to be
    a GPU is never skipped, and the remembered texts stay within their bound."""
    monkeypatch.setattr(devscan, "SKIP_TEXTS", room)
    texts = [*_real_maps(), b"".join(ADVERSARIAL[:-1])] * 2
    keys = sorted({k for t in texts for k in old_maps(t)})
    known = {k: (0 if i % 5 == 0 else None) for i, k in enumerate(keys) if i % 2 == 0}
    skip: set[bytes] = set()
    assert _in_one_scan(texts, known, skip) == _in_one_scan(texts, known, None)
    assert len(skip) <= room and (room < 10 or skip)
    gpu = {k for k, v in known.items() if v == 0}
    assert not any(line.split(b" ")[3:5] == list(k) for line in skip for k in gpu)


@given(st.lists(st.lists(st.lists(_FIELD, max_size=8).map(lambda f: b" ".join(f)), max_size=8), max_size=4))
def test_maps_lines_skipped_by_text_give_the_same_files_on_generated_lines(texts):
    """Maps-like lines in any order, texts read in one scan: skipping by text gives the files of the parse without it."""
    texts = [b"".join(line + b"\n" for line in lines) for lines in texts]
    known = {(b"fd:01", b"12"): None, (b"00:00", b"12"): 0, (b"fd:01", b"012"): None}
    assert _in_one_scan(texts, known, set()) == _in_one_scan(texts, known, None)


@pytest.mark.parametrize("deep", [False, True])
def test_the_scan_gives_the_old_scans_holdings_on_a_tree(tmp_path, deep):
    """Fd holders, map holders (some proven, some cached), unreadable maps, kernel threads, gone pids: the same
    holdings as the scan before, whole-tree and for a list of pids that includes ones that never existed."""
    proc = _tree(tmp_path)
    new, old = _scan(proc, ProcessScan, deep=deep), _scan(proc, OldScan, deep=deep)
    assert list(new.items()) == list(old.items())
    assert any("maps" in h.via for h in new.values()) and any("fd" in h.via for h in new.values())
    assert any("unreadable" in h.via for h in new.values())
    some = [7001, 7003, 7005, 7009, 4_000_123, 7077]
    assert _scan(proc, ProcessScan, some, deep) == _scan(proc, OldScan, some, deep)


def test_a_text_stat_of_still_gets_text_paths(tmp_path):
    """An injected ``stat_of`` (tests, the simulated node) is handed text paths, as before; the default one bytes."""
    proc = _tree(tmp_path)
    seen: list[object] = []

    def stat_of(path):
        seen.append(path)
        return devscan.stat_nosync(path)

    assert _scan(proc, ProcessScan, stat_of=stat_of) == _scan(proc, OldScan)
    assert seen and all(isinstance(p, str) for p in seen)


@pytest.mark.root(reason="needs root: a user reads few processes' fds and maps")
def test_the_scan_gives_the_old_scans_holdings_on_this_machine():
    """On this machine's live /proc, with stand-in holders by fd: every process both scans saw gets the same answer,
    and every holder is found by both."""
    code = "import os,sys,time; fd=os.open(sys.argv[1], os.O_RDONLY); print('ok', flush=True); time.sleep(120)"
    ps = [subprocess.Popen([sys.executable, "-c", code, dev], stdout=subprocess.PIPE) for dev in ["/dev/full"] * 3 + ["/dev/null"]]
    try:
        for p in ps:
            assert p.stdout is not None and p.stdout.readline().strip() == b"ok"
        for _ in range(3):  # other suites start and end processes meanwhile: compare what both saw the same way
            new, old = _scan("/proc", ProcessScan), _scan("/proc", OldScan)
            mine = {p.pid for p in ps[:3]}
            assert mine <= set(new) and mine <= set(old) and ps[3].pid not in new
            both = set(new) & set(old)
            if all(new[p] == old[p] for p in both | mine):
                break
        else:
            pytest.fail("the scans disagree")
    finally:
        for p in ps:
            p.kill()
            p.wait()


def _old_read_bytes(path: str, limit: int = 1 << 20) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def test_describes_file_reads_equal_a_file_objects(tmp_path):
    """``_read_bytes`` (os.open/os.read) gives what ``open(path, "rb").read(limit)`` gave: every status, cgroup and
    command line (cut at 4 KiB and at 7 bytes) of this machine, a large file, a directory, a missing path."""
    from pvegpu.adapters.procfs import _read_bytes

    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * 3000)
    paths = [str(big), str(tmp_path), str(tmp_path / "missing")]
    for name in os.listdir("/proc")[:400]:
        if name.isdigit():
            paths += [f"/proc/{name}/{f}" for f in ("status", "cgroup", "cmdline", "stat")]
    for path in paths:
        for limit in (1 << 20, 4096, 7):
            new, old = _read_bytes(path, limit), _old_read_bytes(path, limit)
            if new != old and os.path.exists(path) and not os.path.isdir(path):  # a live process changed in between
                new, old = _read_bytes(path, limit), _old_read_bytes(path, limit)
            assert new == old or "/proc/" in path, path
    assert _read_bytes(str(big)) == big.read_bytes() and _read_bytes(str(big), 7) == bytes(range(7))
    assert _read_bytes(str(tmp_path)) is None and _read_bytes(str(tmp_path / "missing")) is None


# -- the no-GPU cache holds only what the maps line named -------------------------------------------------------


def _maps_proc(root, pid: int, target: str, dev: str, ino: int) -> None:
    """A process of ``root`` whose maps name (``dev``, ``ino``) at one range, and whose map_files entry for that range
    resolves to ``target`` (what the kernel shows when the range was mapped again between the two reads)."""
    d = root / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "map_files").mkdir()
    (d / "stat").write_bytes(b"%d (job) S 1 0 0 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 123 0 0 0\n" % pid)
    (d / "maps").write_text(f"7f0000000000-7f0000001000 r--p 00000000 {dev} {ino}   /dev/nvidia0\n")
    (d / "map_files" / "7f0000000000-7f0000001000").symlink_to(target)


def test_a_remapped_range_in_one_process_does_not_prove_a_file_no_gpu_for_the_next(tmp_path):
    """A range remapped to a regular file between the maps read and its stat never caches the GPU's key as no GPU for the next process."""
    st = os.stat("/dev/full")
    dev, ino = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    _maps_proc(tmp_path, 8001, str(regular), dev, ino)  # the decoy, scanned first
    _maps_proc(tmp_path, 8002, "/dev/full", dev, ino)  # the hidden holder: maps the stand-in GPU, no fd
    alone = ProcHost(_table(), proc=str(tmp_path), workers=1).holdings([8002])
    assert alone[8002].minors == {0}
    both = ProcHost(_table(), proc=str(tmp_path), workers=1).holdings([8001, 8002])
    assert 8002 in both and 0 in both[8002].minors, both


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
    """A file on btrfs mapped by two processes is stat'ed through map_files once per scan (the cache), not once per process."""
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
