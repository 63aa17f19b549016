"""The faster scan gives the same answers as the one before it: maps parse, escape, kernel threads, describe cache,
parallel workers (issue 20)."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pvegpu.adapters import devscan
from pvegpu.adapters.devscan import ProcessScan, ScanBudget, maps_files
from pvegpu.adapters.procfs import DeviceTable
from pvegpu.safetext import escape

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


def _one_old(ch: str) -> str:
    code = ord(ch)
    if ch == "\\":
        return "\\\\"
    if ch.isprintable():
        return ch
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def old_escape(text: str | bytes, limit: int | None = None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    out: list[str] = []
    size = 0
    for ch in text:
        piece = _one_old(ch)
        if limit is not None and size + len(piece) > limit:
            out.append("...")
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)


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


def test_devscan_keeps_its_pattern():
    """The full pattern still decides every line the split lets through (it is the one of release 19)."""
    assert devscan._MAPS_LINE.pattern == _OLD_LINE.pattern
