"""The Prometheus textfile against the exporter's user (it owns the directory and its parent, as on Debian):
a FIFO, a symlink to /dev/zero, a symlinked directory swap; the audit never hangs, never follows, never writes elsewhere."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from pvegpu.adapters.textfile import HINT, read_previous, write_textfile
from pvegpu.core.errors import EXIT_USAGE, UsageError
from tests import pvelike

EXPORTER = 65534  # the Prometheus service user, reproduced by an unprivileged uid
DOC = {"schema": "pvegpu-audit", "version": 1, "generated_at": 1700000000.0, "attention": False, "nodes": []}

pytestmark = pytest.mark.root
root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files owned by another uid)")


@pytest.fixture
def layout(tmp_path):
    """/var/lib/prometheus/node-exporter as Debian lays it out: both owned by the exporter's user, 0755."""
    parent = tmp_path / "prometheus"
    textdir = parent / "node-exporter"
    textdir.mkdir(parents=True)
    for d in (parent, textdir):
        os.chown(d, EXPORTER, EXPORTER)
        os.chmod(d, 0o755)
    return parent, textdir


def _write_bounded(path: str, limit: float = 5.0):
    """write_textfile in a thread: (finished, exception or None)."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            write_textfile(path, DOC, owners={EXPORTER})
        except BaseException as exc:  # noqa: BLE001
            box[0] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    return not t.is_alive(), box[0]


@root
def test_fifo_at_the_textfile_path_does_not_hang_the_audit(layout):
    """The exporter's user puts a FIFO where pvegpu.prom was: the write finishes at once and replaces it with a file."""
    _, textdir = layout
    fd = os.open(textdir, os.O_RDONLY | os.O_DIRECTORY)
    pvelike.as_uid(EXPORTER, lambda d=fd: os.mkfifo("pvegpu.prom", dir_fd=d))
    os.close(fd)
    done, exc = _write_bounded(str(textdir / "pvegpu.prom"))
    assert done and exc is None
    assert stat.S_ISREG(os.lstat(textdir / "pvegpu.prom").st_mode)


@root
def test_symlink_to_dev_zero_is_neither_read_nor_followed(layout):
    """pvegpu.prom -> /dev/zero: nothing is read from it (no endless read), the link is replaced, /dev/zero untouched."""
    _, textdir = layout
    fd = os.open(textdir, os.O_RDONLY | os.O_DIRECTORY)
    pvelike.as_uid(EXPORTER, lambda d=fd: os.symlink("/dev/zero", "pvegpu.prom", dir_fd=d))
    os.close(fd)
    assert read_previous(os.open(textdir, os.O_PATH | os.O_DIRECTORY), "pvegpu.prom") == ""
    done, exc = _write_bounded(str(textdir / "pvegpu.prom"))
    assert done and exc is None
    assert stat.S_ISREG(os.lstat(textdir / "pvegpu.prom").st_mode) and stat.S_ISCHR(os.stat("/dev/zero").st_mode)


@root
def test_symlinked_directory_swap_is_refused_and_nothing_is_written_elsewhere(layout, tmp_path):
    """The exporter's user swaps node-exporter for a symlink to a root-only directory: refused (exit 2), not followed."""
    parent, textdir = layout
    target = tmp_path / "root-only"  # stands in for /etc/cron.d
    target.mkdir(mode=0o700)
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    pvelike.as_uid(EXPORTER, lambda d=fd: (os.rename("node-exporter", "old", src_dir_fd=d, dst_dir_fd=d),
                                os.symlink(str(target), "node-exporter", dir_fd=d)))
    os.close(fd)
    done, exc = _write_bounded(str(textdir / "pvegpu.prom"))
    assert done and isinstance(exc, UsageError) and exc.exit_code == EXIT_USAGE and exc.hint == HINT
    assert os.listdir(target) == []


@root
def test_textfile_directory_of_a_stranger_or_writable_by_others_is_refused(layout):
    """A directory owned by neither root nor the exporter's user, or writable by others, is refused (exit 2)."""
    _, textdir = layout
    os.chown(textdir, 4242, 4242)
    done, exc = _write_bounded(str(textdir / "pvegpu.prom"))
    assert done and isinstance(exc, UsageError)
    os.chown(textdir, EXPORTER, EXPORTER)
    os.chmod(textdir, 0o777)
    done, exc = _write_bounded(str(textdir / "pvegpu.prom"))
    assert done and isinstance(exc, UsageError)
    assert os.listdir(textdir) == []


@root
def test_exporter_owned_directory_is_written_and_previous_timestamps_kept(layout):
    """The normal case: the exporter's own directory is written (0644), a previous regular file is read back."""
    _, textdir = layout
    path = textdir / "pvegpu.prom"
    path.write_text('pvegpu_audit_last_success_timestamp_seconds{node="pve1"} 1.6e+09\n')
    assert 'node="pve1"' in read_previous(os.open(textdir, os.O_PATH | os.O_DIRECTORY), "pvegpu.prom")
    done, exc = _write_bounded(str(path))
    assert done and exc is None
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644 and os.listdir(textdir) == ["pvegpu.prom"]
