"""The one atomic writer and safe reader (adapters/safefile.py) and the journal's escaping through safetext."""

from __future__ import annotations

import os
import socket

from pvegpu.adapters import journal, safefile


def test_write_atomic_replaces_a_planted_symlink_and_sets_the_mode(tmp_path):
    """A symlink at the target is replaced, never followed; the mode is the one asked for; no temp file is left."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "out").symlink_to(victim)
    safefile.write_atomic(str(tmp_path / "out"), b"new", mode=0o640)
    assert victim.read_text() == "keep" and not (tmp_path / "out").is_symlink()
    assert (tmp_path / "out").read_bytes() == b"new" and (os.stat(tmp_path / "out").st_mode & 0o777) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["out", "victim"]


def test_write_atomic_relative_to_a_directory_fd(tmp_path):
    """With ``dir_fd`` the name is taken relative to the directory opened once (the textfile's and the token's way)."""
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        safefile.write_atomic("t", b"x" * 70000, mode=0o600, dir_fd=dfd, fsync=False)
        assert safefile.read_regular("t", dfd) == b"x" * 70000
    finally:
        os.close(dfd)


def test_read_regular_refuses_links_fifos_and_oversize(tmp_path):
    """Only a regular file within the limit is read: a symlink, a FIFO (never blocks) or a file over the limit is None."""
    (tmp_path / "f").write_bytes(b"12345")
    (tmp_path / "l").symlink_to(tmp_path / "f")
    os.mkfifo(tmp_path / "p")
    assert safefile.read_regular(str(tmp_path / "f")) == b"12345"
    assert safefile.read_regular(str(tmp_path / "f"), limit=5) == b"12345"
    assert safefile.read_regular(str(tmp_path / "f"), limit=4) is None
    assert safefile.read_regular(str(tmp_path / "l")) is None
    assert safefile.read_regular(str(tmp_path / "p")) is None
    assert safefile.read_regular(str(tmp_path / "missing")) is None


def test_journal_line_is_escaped_by_safetext(tmp_path):
    """The system-log line escapes tenant control characters with the one escaper (safetext), cut to 1 KiB."""
    path = str(tmp_path / "log")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        assert journal.log_line("CT 129 \x1b[2J\nfake\\" + "x" * 2000, path)
        data = s.recv(4096).decode()
    text = data.split(": ", 1)[1]
    assert text.startswith("CT 129 \\x1b[2J\\x0afake\\\\") and len(text) == 1024 and text.isprintable()
