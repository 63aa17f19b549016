"""The one-start override of the start gate: ``pvegpu hook allow-once VMID`` drops a token file that the
next ``pre-start`` of that container consumes.

Manual equivalent: ``echo > /run/pvegpu/allow-once/129`` (but written atomically, never through a link,
and only honoured while fresh and complete). The directory is pvegpu's own, checked like the reset locks'
(``adapters/locks.open_dir``: this user's, mode 0700, in a parent nobody else may write); a token in a
directory that fails the checks is not honoured, and the hook says so.

A token's age is measured on the boot clock (``CLOCK_BOOTTIME``, stored with the boot id), so a wall clock
stepped back or forward (NTP, an admin) neither drops nor stretches it; a token from another boot is judged by
the wall clock. A token that is not used (too old, incomplete, in a bad directory) is removed and the reason
given to the caller.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pvegpu.adapters.locks import open_dir
from pvegpu.adapters.safefile import open_nofollow, read_regular, write_atomic
from pvegpu.core.errors import UsageError

MAGIC = "pvegpu-allow-once"
WHAT, SETTING = "allow-once token directory", "gate.override_dir"


def _boot() -> tuple[str, float]:
    """(this boot's id, seconds since boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read(64).strip()
    except OSError:
        boot_id = ""
    return boot_id, time.clock_gettime(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))


@dataclass(frozen=True)
class Token:
    """One token as written: where, for which CT, and its bytes (``withdraw`` removes only these)."""

    path: str
    vmid: int
    data: bytes


def allow_once(override_dir: str, vmid: int) -> Token:
    """Write CT ``vmid``'s token atomically (a partial token is never seen).
    Raises UsageError when the directory fails the checks, OSError when it cannot be written."""
    dfd = open_dir(override_dir, create=True, what=WHAT, setting=SETTING)
    name = str(vmid)
    try:
        boot_id, up = _boot()
        data = f"{MAGIC} {time.time():.0f} uid={os.getuid()} boot={boot_id} up={up:.6f} by={os.getpid()}\n".encode()
        write_atomic(name, data, mode=0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    return Token(os.path.join(override_dir, name), vmid, data)


def withdraw(override_dir: str, token: Token) -> bool:
    """Remove ``token`` if no start consumed it (a start that failed before its hookscript ran): a token written for
    one start must not waive a later start's refusal. Only that token: one written since (an admin's
    ``pvegpu hook allow-once``) has other bytes and stays. True when it was removed."""
    dfd = _open(override_dir, token.vmid, None)
    if dfd is None:
        return False
    try:
        if read_regular(str(token.vmid), dfd, limit=len(token.data) + 1) != token.data:
            return False
        os.unlink(str(token.vmid), dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


def _judge(dfd: int, vmid: int, ttl: float) -> tuple[float | None, str]:
    """(the token's age in seconds if it is complete and no older than ``ttl``, else None; why not)."""
    try:
        fd = open_nofollow(str(vmid), dfd)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"it cannot be opened ({exc.strerror})"
    try:
        st = os.fstat(fd)
        text = os.read(fd, 256).decode("ascii", "replace") if st.st_uid == os.geteuid() else ""
    finally:
        os.close(fd)
    if not text.startswith(MAGIC + " "):
        return None, "it is incomplete or not pvegpu's"
    fields = dict(w.split("=", 1) for w in text.split()[2:] if "=" in w)
    boot_id, up = _boot()
    try:
        same_boot = bool(boot_id) and fields.get("boot") == boot_id and "up" in fields
        age = up - float(fields["up"]) if same_boot else time.time() - float(text.split()[1])
    except (ValueError, IndexError):
        return None, "it is incomplete or not pvegpu's"
    if not same_boot and age < -60:
        return None, f"it was written {-age:.0f} s in the future (wall clock), on another boot"
    if age > ttl:
        return None, f"it is {age:.0f} s old (an override lasts gate.override_ttl = {ttl:g} s)"
    return max(0.0, age), ""


def _open(override_dir: str, vmid: int, dropped: list[str] | None) -> int | None:
    try:
        return open_dir(override_dir, create=False, what=WHAT, setting=SETTING)
    except FileNotFoundError:
        return None
    except (OSError, UsageError) as exc:
        if dropped is not None and os.path.lexists(os.path.join(override_dir, str(vmid))):
            dropped.append(f"its directory is not trusted: {getattr(exc, 'message', exc)}")
        return None


def pending(override_dir: str, vmid: int, ttl: float) -> bool:
    """Is a fresh, complete token waiting for CT ``vmid``'s next start? (Read only; ``take`` consumes it.)"""
    dfd = _open(override_dir, vmid, None)
    if dfd is None:
        return False
    try:
        return _judge(dfd, vmid, ttl)[0] is not None
    finally:
        os.close(dfd)


def take(override_dir: str, vmid: int, ttl: float, dropped: list[str] | None = None) -> str | None:
    """Consume CT ``vmid``'s token if there is a fresh, complete one; returns its description. A token that is there
    but not honoured is removed too, and why goes into ``dropped``."""
    dfd = _open(override_dir, vmid, dropped)
    if dfd is None:
        return None
    try:
        age, why = _judge(dfd, vmid, ttl)
        if age is None and not why:
            return None  # no token
        try:
            os.unlink(str(vmid), dir_fd=dfd)  # consumed whatever it held: a stale or partial token is not left for later
        except OSError:
            return None  # another start took it first
    finally:
        os.close(dfd)
    if age is None:
        if dropped is not None:
            dropped.append(why)
        return None
    return f"{os.path.join(override_dir, str(vmid))}, {age:.0f} s old"
