"""The scan's parsers give the regex's answers (maps, status, escape); kernel threads, the describe cache, the
forked workers."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pvegpu.adapters import devscan
from pvegpu.adapters.devscan import ProcessScan, ScanBudget, maps_files
from pvegpu.adapters.procfs import DeviceTable
from pvegpu.core.safetext import each_escaped, escape

# -- the parsers as they were before issue 20: the reference the new ones must equal ---------------------------

_OLD_LINE = re.compile(rb"^([0-9a-f]+-[0-9a-f]+) \S+ \S+ ([0-9a-f]+:[0-9a-f]+) ([1-9][0-9]*) ", re.M)


def old_maps(text: bytes) -> dict[tuple[bytes, bytes], bytes]:
    """The regex parse of release 19 over the complete lines of ``text``."""
    files: dict[tuple[bytes, bytes], bytes] = {}
    cut = text.rfind(b"\n") + 1
    for rng, dev, ino in _OLD_LINE.findall(text, 0, cut):
        files.setdefault((dev, ino), rng)
    return files


def new_maps(text: bytes) -> dict[tuple[bytes, bytes], bytes]:
    files: dict[tuple[bytes, bytes], bytes] = {}
    lines = text.split(b"\n")
    lines.pop()
    maps_files(lines, files)
    return files


def old_escape(text: str | bytes, limit: int | None = None) -> str:
    """The escape without its fast path: every character escaped one by one (``safetext.each_escaped``)."""
    return each_escaped(text.decode("utf-8", "surrogateescape") if isinstance(text, bytes) else text, limit)


def _real_maps() -> list[bytes]:
    texts = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/maps", "rb") as f:
                    texts.append(f.read())
            except OSError:
                pass
    return texts


ADVERSARIAL = [
    b"7f0000000000-7f0000001000 r--s 00000000 00:05 1234                       /dev/nvidia0\n",
    b"7f0000001000-7f0000002000 rw-s 00000000 00:05 1234                       /dev/nvidia0 (deleted)\n",
    b"7f0000002000-7f0000003000 r--p 00000000 fd:01 777                        /tmp/a file with spaces /dev/nvidia3\n",
    b"7f0000003000-7f0000004000 r--p 00000000 fd:01 778                        /tmp/new\\012line 00:05 1234 x\n",
    b"7f0000004000-7f0000005000 r--p 00000000 fd:01 779                        /tmp/x (deleted) (deleted)\n",
    b"7f0000005000-7f0000006000 rw-p 00000000 00:00 0                          [heap]\n",
    b"7f0000006000-7f0000007000 rw-p 00000000 00:00 0 \n",
    b"7f0000007000-7f0000008000 rw-p 00000000 00:00 0\n",
    b"7f0000008000-7f0000009000 r--p 00000000 fd:01 0780                       /tmp/leading-zero-inode\n",
    b"7f0000009000-7f000000a000 r--p 00000000 fd:01 781\n",  # no space after the inode: the old pattern skips it
    b"7f000000a000-7f000000b000 r--p 00000000 fd:01 782 \n",
    b"7f000000b000-7f000000c000  r--p 00000000 fd:01 783 /tmp/double-space\n",
    b"7f000000c000-7f000000d000 r\t-p 00000000 fd:01 784 /tmp/tab-in-perms\n",
    b"XYZ-7f000000e000 r--p 00000000 fd:01 785 /tmp/bad-range\n",
    b"7f000000e000-7f000000f000 r--p 00000000 fd01 786 /tmp/bad-dev\n",
    b"7f000000f000-7f0000010000 r--p 00000000 fd:01 12a /tmp/bad-inode\n",
    b"7f0000010000-7f0000011000 r--p 00000000 fd:01 787 " + b"/" + b"d" * 200_000 + b"\n",  # a huge line
    b"7f0000011000-7f0000012000 r--p 00000000 fd:01 777 /tmp/same-file-again\n",
    b"\n",
    b"garbage without fields\n",
    b"7f0000012000-7f0000013000 r--p 00000000 fd:01 788 /tmp/cut-at-the-end",  # not ended: never a line
]


@pytest.mark.root(reason="needs root: a user reads few processes' maps, too few texts to compare")
def test_maps_parse_equals_the_regex_on_every_real_maps_text_of_this_machine():
    """The split-based maps parse gives the same files (dev, inode -> first range) as the old regex, on every
    readable /proc/*/maps of this machine, whole and cut into odd pieces."""
    texts = _real_maps()
    assert len(texts) > 10 and sum(t.count(b"\n") for t in texts) > 500
    for text in texts:
        assert new_maps(text) == old_maps(text)
        for n in (1, 7, 333):  # every n-th line only: other neighbours, other first ranges
            part = b"".join(line + b"\n" for line in text.split(b"\n")[::n] if line)
            assert new_maps(part) == old_maps(part)


def test_maps_parse_equals_the_regex_on_crafted_lines():
    """Deleted files, spaces and escaped newlines in paths, odd fields, huge and unended lines: same files as the regex."""
    text = b"".join(ADVERSARIAL)
    assert new_maps(text) == old_maps(text)
    assert (b"00:05", b"1234") in new_maps(text) and (b"fd:01", b"788") not in new_maps(text)
    for i in range(len(ADVERSARIAL)):  # each line alone, and each rotation (another line first)
        assert new_maps(ADVERSARIAL[i]) == old_maps(ADVERSARIAL[i])
        rot = b"".join(ADVERSARIAL[i:] + ADVERSARIAL[:i])
        if not rot.endswith(b"\n"):
            rot += b"\n"
        assert new_maps(rot) == old_maps(rot)


_FIELD = st.sampled_from([b"7f00-7f01", b"0-1", b"x-1", b"r--p", b"rw-s", b"00000000", b"fd:01", b"00:00", b"0", b"12", b"012",
                          b"", b"a b", b"\t", b"(deleted)", b"/dev/nvidia0", b"\\012"])


@given(st.lists(st.lists(_FIELD, max_size=8).map(lambda f: b" ".join(f)), max_size=12))
def test_maps_parse_equals_the_regex_on_generated_lines(lines):
    """Lines built from maps-like fields in any order and count: the same files as the regex."""
    text = b"".join(line + b"\n" for line in lines)
    assert new_maps(text) == old_maps(text)


def test_maps_read_in_chunks_equals_the_regex(tmp_path):
    """Through the real chunked reader (lines cut at every 64 KiB boundary, one line longer than a chunk), the
    files handed to the proof are the regex's."""
    text = b"".join(ADVERSARIAL[:-1]) * 3 + b"".join(
        b"%012x-%012x r--p 00000000 fd:%02x %d /lib/x%d.so\n" % (i, i + 1, i % 7, 1000 + i % 300, i) for i in range(5000))
    pid = 4_000_001
    (tmp_path / str(pid)).mkdir()
    (tmp_path / str(pid) / "maps").write_bytes(text)
    seen: dict[tuple[bytes, bytes], bytes] = {}

    class Capture(ProcessScan):
        def _prove(self, proc, pid, leader_zombie, files, minors, via):
            seen.update(files)
            return False

    Capture(DeviceTable({}), ScanBudget(), {}, clock=lambda: 0.0)._scan_maps(str(tmp_path), pid, False, set(), set())
    assert seen == old_maps(text) and len(seen) > 300


# -- escape ----------------------------------------------------------------------------------------------------


@given(st.one_of(st.text(), st.binary(), st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126))),
       st.one_of(st.none(), st.integers(min_value=-2, max_value=40)))
def test_escape_fast_path_equals_the_old_escape(text, limit):
    """Printable ASCII is returned as is, everything else escaped as before: equal to the old escape, any limit."""
    assert escape(text, limit) == old_escape(text, limit)


@pytest.mark.parametrize("text", ["plain", "with\\backslash", "tab\there", "é", "", "x" * 600, "\x7f", "a b"])
def test_escape_fast_path_edges(text):
    """Backslash, DEL, non-ASCII, empty and over-long texts: the same as the old escape, at and around the limit."""
    for limit in (None, 0, 1, 5, 512, len(text), len(text) - 1):
        assert escape(text, limit) == old_escape(text, limit)
        assert escape(text.encode(), limit) == old_escape(text.encode(), limit)


_FIELD = st.sampled_from([b"", b"0", b"7", b"00", b"10", b"a", b"f", b"g", b"A", b"-", b":", b"\t", b"\x0b", b"\r", b"\xff",
                          b"7f00-7f10", b"fd:01", b"r-xp", b"00001000", b"12345", b"0a-", b":1", b"1:"])


@given(st.lists(st.lists(_FIELD, max_size=3).map(b"".join), min_size=6, max_size=6))
def test_the_hand_match_of_a_maps_line_is_the_pattern_of_release_19(fields):
    """Each line the split lets through is decided as the full pattern of release 19 decides it (``_file_line``)."""
    line = b" ".join(fields)
    p = line.split(b" ", 5)
    m = _OLD_LINE.match(line)
    got = devscan._file_line(p) if len(p) == 6 else None
    assert got == (None if m is None else (m[1], m[2], m[3]))


# -- status in one pass ----------------------------------------------------------------------------------------

from pvegpu.adapters import procfs, scanpool  # noqa: E402
from pvegpu.adapters.procfs import ProcHost, kernel_thread, parse_status, status_facts, term_futile  # noqa: E402
from pvegpu.core.model import Place  # noqa: E402


def _old_facts(data: bytes) -> tuple[list[int], int | None, bool]:
    nspid, uid, _threads = parse_status(data)
    return nspid, uid, term_futile(data, nspid)


def test_status_in_one_pass_equals_the_two_parsers_on_every_real_status():
    """status_facts gives parse_status's NSpid and Uid and term_futile's answer on every /proc/*/status here."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            assert status_facts(data) == _old_facts(data)
            n += 1
    assert n > 10


_STATUS_LINE = st.sampled_from([b"Name:\tx", b"NSpid:\t5\t1", b"NSpid:\t5\t3\t1", b"NSpid:\tbad", b"Uid:\t0\t0\t0\t0", b"Uid:",
                                b"Uid:\tx", b"TracerPid:\t0", b"TracerPid:\t77", b"TracerPid:", b"SigIgn:\t0000000000004000",
                                b"SigIgn:\t0", b"SigIgn:\tzz", b"SigCgt:\t0000000000004000", b"SigCgt:\t0", b"SigCgt:\tq",
                                b"Threads:\t3", b"", b"garbage"])


@given(st.lists(_STATUS_LINE, max_size=12))
def test_status_in_one_pass_equals_the_two_parsers_on_generated_texts(lines):
    """Any order, repetition or damage of the lines that matter: the same three facts as the two parsers."""
    data = b"\n".join(lines)
    assert status_facts(data) == _old_facts(data)


# -- kernel threads ----------------------------------------------------------------------------------------------


def _stat_text(pid: int, flags: int) -> bytes:
    return b"%d (kworker/0:1) I 2 0 0 0 -1 %d 0 0 0 0 0 0 0 0 20 0 1 0 123 0 0 0\n" % (pid, flags)


def test_kernel_thread_flag_is_read_from_stat():
    """PF_KTHREAD in field 9 marks a kernel thread, whatever the name (even one with spaces and parentheses)."""
    assert kernel_thread(_stat_text(9, 0x00208040))
    assert not kernel_thread(_stat_text(9, 0x00400100))
    assert not kernel_thread(b"9 (a) b) S 1 0 0 0 -1 4194560 0 0\n")  # a user process whose name fakes a ")"
    assert not kernel_thread(b"") and not kernel_thread(None) and not kernel_thread(b"9 (x) S 1 0 0 0 -1 zz 0\n")


def test_kernel_threads_are_not_scanned_and_user_processes_still_are(tmp_path):
    """A pid with no fd whose stat has PF_KTHREAD is skipped before its maps are read; the same tree with the flag
    cleared maps the stand-in device (so the skip is what hides it, not a broken tree); stat is read only then."""
    full = os.stat("/dev/full").st_rdev
    table = DeviceTable({(os.major(full), os.minor(full)): 0})
    for pid, flags in ((4301, 0x00208040), (4302, 0x00400100)):
        d = tmp_path / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "map_files").mkdir()
        (d / "stat").write_bytes(_stat_text(pid, flags))
        (d / "maps").write_bytes(b"7f000000-7f001000 rw-s 00000000 00:05 901 /dev/nvidia0\n")
        (d / "map_files" / "7f000000-7f001000").symlink_to("/dev/full")
    held = ProcHost(table, proc=str(tmp_path)).holdings([4301, 4302])
    assert 4301 not in held and held[4302].minors == {0} and held[4302].via == {"maps"}


def test_stat_is_read_only_for_a_process_without_fds(tmp_path):
    """A process with an open fd is scanned without its stat: a stat that says kernel thread does not hide its GPU fd
    (no kernel thread has fds)."""
    full = os.stat("/dev/full").st_rdev
    table = DeviceTable({(os.major(full), os.minor(full)): 0})
    d = tmp_path / "4303"
    (d / "fd").mkdir(parents=True)
    (d / "fd" / "3").symlink_to("/dev/full")
    (d / "stat").write_bytes(_stat_text(4303, 0x00208040))
    (d / "maps").write_bytes(b"")
    assert ProcHost(table, proc=str(tmp_path)).holdings([4303])[4303].minors == {0}


def test_a_maps_read_cut_short_leaves_the_mapping_counting_on_every_gpu(tmp_path, monkeypatch):
    """A maps read that ends over budget after one GPU's mapping says nothing of the others: the mapping is not
    dropped on a GPU the read never reached (unknown is never "maps none")."""
    from pvegpu.core.holders import via_on

    def cut_short(self, proc, pid, zombie, minors, via):
        minors.add(0)
        via.add("maps")
        raise devscan._OverBudget

    monkeypatch.setattr(ProcessScan, "_scan_maps", cut_short)
    d = tmp_path / "4304"
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_bytes(_stat_text(4304, 0x00400100))
    held = ProcHost(DeviceTable({}), proc=str(tmp_path)).holdings([4304])[4304]
    assert held.mapped is None and "maps" in via_on(held, 1) and "unreadable" in held.via


def test_real_kernel_threads_hold_nothing():
    """Every kernel thread on this machine (if any is visible) is absent from a whole scan; as root, where the old
    scan read their empty fd tables and maps, the answer is the same."""
    full = os.stat("/dev/full").st_rdev
    host = ProcHost(DeviceTable({(os.major(full), os.minor(full)): 0}), workers=1)
    kthreads = []
    for pid in host.all_pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if kernel_thread(f.read()):
                    kthreads.append(pid)
        except OSError:
            pass
    held = host.holdings()
    assert not set(kthreads) & set(held)


# -- describe ----------------------------------------------------------------------------------------------------


def _fake_proc(tmp_path, pid: int, start: int, cgroup: bytes, cmdline: bytes) -> None:
    d = tmp_path / "proc" / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_bytes(b"%d (job) S 1 %d %d 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 %d 0 0 0\n" % (pid, pid, pid, start))
    (d / "status").write_bytes(b"Name:\tjob\nUid:\t1000\t1000\t1000\t1000\nNSpid:\t%d\t7\n" % pid)
    (d / "cgroup").write_bytes(cgroup)
    (d / "cmdline").write_bytes(cmdline)


def test_describe_rereads_state_and_placement_but_the_command_line_once_per_identity(tmp_path):
    """Within one run: a moved process is seen moved and a frozen cgroup frozen at the next describe; its command
    line (display only) is read once; a recycled pid (another start time) gets its own command line."""
    cg = tmp_path / "cg"
    for v in ("301", "302"):
        (cg / "lxc" / v / "ns").mkdir(parents=True)
        (cg / "lxc" / v / "ns" / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    _fake_proc(tmp_path, 4401, 100, b"0::/lxc/301/ns\n", b"python3\0train.py\0")
    host = ProcHost(DeviceTable({}), proc=str(tmp_path / "proc"), cgroup_root=str(cg))
    first = host.describe(4401)
    assert first.placement.vmid == 301 and first.cmdline == "python3 train.py" and not first.frozen
    (tmp_path / "proc" / "4401" / "cgroup").write_bytes(b"0::/lxc/302/ns\n")
    (tmp_path / "proc" / "4401" / "cmdline").write_bytes(b"changed\0")
    (cg / "lxc" / "302" / "ns" / "cgroup.events").write_text("populated 1\nfrozen 1\n")
    again = host.describe(4401)
    assert again.placement.vmid == 302 and again.frozen and again.ns_pid == 7
    assert again.cmdline == "python3 train.py"  # the same identity: not read again
    _fake_proc(tmp_path, 4401, 200, b"0::/lxc/302/ns\n", b"other\0")
    assert host.describe(4401).cmdline == "other"  # a new process on the pid: read
    assert ProcHost(DeviceTable({}), proc=str(tmp_path / "proc"), cgroup_root=str(cg)).describe(4401).cmdline == "other"


def test_describe_of_an_unreadable_cgroup_is_unknown_and_not_frozen(tmp_path):
    """One read of /proc/<pid>/cgroup decides both: unreadable is UNKNOWN placement and never frozen."""
    _fake_proc(tmp_path, 4402, 100, b"", b"x\0")
    os.remove(tmp_path / "proc" / "4402" / "cgroup")
    info = ProcHost(DeviceTable({}), proc=str(tmp_path / "proc"), cgroup_root=str(tmp_path)).describe(4402)
    assert info.placement.place is Place.UNKNOWN and not info.frozen


# -- forked scan workers -----------------------------------------------------------------------------------------


@pytest.fixture
def small_shares(monkeypatch):
    """Shares of a few pids, so that this machine's few processes are spread over workers."""
    monkeypatch.setattr(scanpool, "MIN_PER_WORKER", 5)


@pytest.fixture
def holders():
    """Five processes holding the stand-in device (/dev/full), one holding /dev/null."""
    import subprocess
    import sys

    code = "import os,sys,time; fd=os.open(sys.argv[1], os.O_RDONLY); print('ok', flush=True); time.sleep(120)"
    ps = [subprocess.Popen([sys.executable, "-c", code, dev], stdout=subprocess.PIPE) for dev in ["/dev/full"] * 5 + ["/dev/null"]]
    for p in ps:
        assert p.stdout.readline().strip() == b"ok"
    yield ps
    for p in ps:
        p.kill()
        p.wait()


def _table() -> DeviceTable:
    full = os.stat("/dev/full").st_rdev
    return DeviceTable({(os.major(full), os.minor(full)): 0})


def test_forked_workers_give_the_serial_answer_on_a_still_tree(small_shares, tmp_path):
    """On a /proc-like tree that does not change (fd holders, mappers, unreadable and kernel-thread pids), a
    whole-node scan over 2, 3 and 4 shares gives exactly the serial scan's holdings, in the same order."""
    for i in range(60):
        pid = 5000 + i
        d = tmp_path / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "stat").write_bytes(_stat_text(pid, 0x00208040 if i % 11 == 0 else 0x00400100))
        (d / "maps").write_bytes(b"7f00-7f01 r--p 00000000 fd:01 %d /lib/x.so\n" % (100 + i % 4))
        if i % 3 == 0:
            (d / "fd" / "3").symlink_to("/dev/full")
        if i % 5 == 0:
            (d / "fd" / "4").symlink_to("/dev/null")
        if i % 7 == 0:
            (d / "maps").unlink()
            (d / "maps").mkdir()  # unreadable maps (EISDIR): unknown, never "holds nothing"
    serial = ProcHost(_table(), proc=str(tmp_path), workers=1).holdings()
    assert len(serial) > 20 and any("unreadable" in h.via for h in serial.values())
    for n in (2, 3, 4):
        par = ProcHost(_table(), proc=str(tmp_path), workers=n).holdings()
        assert list(par.items()) == list(serial.items())


@pytest.mark.root(reason="needs root: as a user the whole-node scan reads only the user's own processes")
def test_forked_workers_find_real_holders(small_shares, holders):
    """On this machine's live /proc, a whole-node scan over 2 and 4 shares finds every stand-in holder, by fd,
    and not the /dev/null one; every process seen by both scans with the same start time gets the same answer."""
    serial = ProcHost(_table(), workers=1).holdings()
    mine = {p.pid for p in holders[:5]}
    assert mine <= set(serial) and holders[5].pid not in serial
    for n in (2, 4):
        host = ProcHost(_table(), workers=n)
        assert scanpool.shares(len(host.all_pids()), n) == n and scanpool.forkable()
        par = host.holdings()
        assert {p: par[p] for p in mine} == {p: serial[p] for p in mine} and holders[5].pid not in par


@pytest.mark.parametrize("how", ["crash", "garbage", "late"])
def test_a_failed_worker_share_is_scanned_again_here(small_shares, holders, monkeypatch, how):
    """A worker that dies, answers garbage or runs past the deadline is killed and its share scanned serially:
    the holders are all found, and no worker is left behind."""
    import time

    def bad(host, part, deep, end, w, r, mask, stop=None):
        if how == "crash":
            os._exit(3)
        if how == "garbage":
            os.write(w, b"\x00not marshal")
            return
        time.sleep(60)

    monkeypatch.setattr(scanpool, "_worker", bad)
    monkeypatch.setattr(scanpool, "GRACE", 0.3)
    host = ProcHost(_table(), workers=2, budget=procfs.ScanBudget(total=1.0))
    t = time.monotonic()
    held = host.holdings()
    assert {p.pid for p in holders[:5]} <= set(held) or how == "late"
    if how == "late":  # past the deadline: the late share is unknown (budget), never "holds nothing"
        late = [p.pid for p in holders[:5] if p.pid not in held or held[p.pid].minors != {0}]
        assert all(held[p].via == {"unreadable", "budget"} for p in late)
    assert time.monotonic() - t < 5
    kids = [p for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == os.getpid()]
    assert set(map(int, kids)) <= {p.pid for p in holders}


def _ppid(pid: int) -> int | None:
    from pvegpu.adapters.procstat import read_stat

    st = read_stat(pid)
    return st.ppid if st is not None and st.state not in ("Z", "X") else None


def test_workers_hold_none_of_the_parents_fds(small_shares, monkeypatch, tmp_path):
    """A worker closes every inherited fd but its pipe: the parent's stand-in GPU fd is not held by any worker."""
    seen = tmp_path / "fds"
    real = scanpool._serial

    def spy(host, part, deep, end, out, stop=None):
        if os.getpid() != parent:
            seen.write_text(" ".join(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                                     if os.path.exists(f"/proc/self/fd/{fd}")))
        return real(host, part, deep, end, out, stop)

    parent = os.getpid()
    monkeypatch.setattr(scanpool, "_serial", spy)
    fd = os.open("/dev/full", os.O_RDONLY)
    try:
        ProcHost(_table(), workers=2).holdings()
    finally:
        os.close(fd)
    assert seen.exists() and "/dev/full" not in seen.read_text()


def test_no_fork_outside_the_main_thread_or_beside_another_thread(small_shares):
    """Beside another Python thread (a scan left stuck, say), or from a thread, the scan stays serial."""
    import threading

    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not scanpool.forkable()
    finally:
        stop.set()
        t.join()
    box = []
    t = threading.Thread(target=lambda: box.append(scanpool.forkable()))
    t.start()
    t.join()
    assert box == [False] and scanpool.forkable()


def test_statx_with_its_own_buffer_equals_the_plain_one(tmp_path):
    """StatNosync (one buffer per scan) gives stat_nosync's and os.stat's (mode, rdev) for devices, files, dirs,
    links to devices, and the same error for a missing path."""
    from pvegpu.adapters.devscan import StatNosync, stat_nosync

    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "l").symlink_to("/dev/zero")
    fast = StatNosync()
    for path in ("/dev/full", "/dev/null", "/dev/zero", "/dev/urandom", str(tmp_path / "f"), str(tmp_path), str(tmp_path / "l"),
                 "/proc/self/fd/0"):
        st = os.stat(path)
        assert fast(path) == stat_nosync(path) == (st.st_mode, st.st_rdev)
    with pytest.raises(FileNotFoundError):
        fast(str(tmp_path / "missing"))
    assert ProcessScan(DeviceTable({}), ScanBudget(), {})._stat.__class__ is StatNosync


def test_a_worker_never_runs_the_parents_signal_handlers(small_shares, holders, monkeypatch, tmp_path):
    """A signal reaching a worker takes its default action (here: SIGUSR1 ends it), never the handler this process
    installed; the share of the worker it ended is scanned here, so the holders are all still found."""
    import signal

    marks = tmp_path / "handled"
    parent = os.getpid()
    real = scanpool._serial

    def poke(host, part, deep, end, out, stop=None):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real(host, part, deep, end, out, stop)

    def handler(signum, frame):
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")

    old = signal.signal(signal.SIGUSR1, handler)
    monkeypatch.setattr(scanpool, "_serial", poke)
    try:
        held = ProcHost(_table(), workers=2).holdings()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert not marks.exists()
    assert {p.pid for p in holders[:5]} <= set(held) and all(held[p.pid].minors == {0} for p in holders[:5])
