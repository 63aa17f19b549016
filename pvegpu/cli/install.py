"""`pvegpu hook install | uninstall | status`: put the start gate on containers, take it off, report.

Manual equivalent: copy the guard to ``/var/lib/vz/snippets/``, ``pvesm set local --content ...,snippets``,
``pct set 129 --hookscript local:snippets/pvegpu-guard`` (root@pam only: API tokens cannot set hookscripts),
and the same file on every node the container may start on (a missing snippet stops restores and migrations
from starting).
"""

from __future__ import annotations

import enum
import errno
import importlib.util
import os
import re
import shlex
import shutil
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from pvegpu.adapters import safefile
from pvegpu.adapters.child import call_in_child
from pvegpu.adapters.etcpve import ct_confs, ha_files, node_names, vm_confs
from pvegpu.adapters.pvecli import run_command
from pvegpu.adapters.storagecfg import Storage, read_storage
from pvegpu.core import errors as E
from pvegpu.core.errors import PvegpuError, UsageError
from pvegpu.core.ha import HaVerdict, judge
from pvegpu.core.lxcconf import parse_config
from pvegpu.core.safetext import escape

GUARD = "pvegpu-guard"
STORAGE_DEADLINE = 10.0  # seconds one storage's files may take to answer (a dead NFS/CIFS mount never does)
Runner = Callable[[list[str]], tuple[int, str]]
SnippetLister = Callable[[str], "set[str] | None"]  # node -> snippet file names there, None = unknown


def pvegpu_path() -> str:
    """The absolute path of this pvegpu's command: the one beside this interpreter (a venv's bin/), else PATH's."""
    beside = os.path.join(os.path.dirname(sys.executable), "pvegpu")
    if os.access(beside, os.X_OK):
        return os.path.abspath(beside)
    found = shutil.which("pvegpu")
    return os.path.abspath(found) if found else "/usr/local/bin/pvegpu"


def guard_text(template: str, pvegpu_bin: str | None = None, fast: bool = True) -> str:
    """The guard with PVEGPU set to an absolute path and, if ``fast``, the -S fast path filled in
    (every value shell-quoted: a path is data, never shell text)."""
    pvegpu_bin = os.path.abspath(pvegpu_bin or pvegpu_path())
    text = template.replace("PVEGPU=/usr/local/bin/pvegpu\n", f"PVEGPU={shlex.quote(pvegpu_bin)}\n")
    where = fast_path() if fast else None
    if where:
        text = text.replace("PVEGPU_PYTHON=\n", f"PVEGPU_PYTHON={shlex.quote(sys.executable)}\n")
        text = text.replace("PVEGPU_PYTHONPATH=\n", f"PVEGPU_PYTHONPATH={shlex.quote(where)}\n")
    return text


GATE_PACKAGES = ("pvegpu", "pynvml")  # all the gate imports beyond the standard library (NVML through nvidia-ml-py)


def fast_path() -> str | None:
    """The guard's import path for ``python -I -S`` (no site, so no ``.pth`` files): the directory each of
    ``GATE_PACKAGES`` is imported from, pvegpu's first, joined by ":"; None when one cannot be found, or a directory
    holds a ":" (the guard then runs the ``pvegpu`` command)."""
    dirs: list[str] = []
    for name in GATE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            return None
        where = os.path.dirname(spec.origin)  # a module's directory; a package's parent
        dirs.append(os.path.dirname(where) if spec.submodule_search_locations is not None else where)
    if any(":" in d or not d for d in dirs):
        return None
    return ":".join(dict.fromkeys(dirs))


def write_atomic(path: str, text: str, mode: int = 0o755) -> None:
    """Write ``path`` as root safely: a new file (O_CREAT|O_EXCL|O_NOFOLLOW) in the same directory, mode set with
    fchmod, fsync'd, then renamed over ``path``. A symlink planted at ``path`` is replaced, never followed."""
    _check_dir(os.path.dirname(path))
    safefile.write_atomic(path, text.encode("utf-8"), mode=mode)


def read_nofollow(path: str) -> str | None:
    """The text of a regular file at ``path`` (not through a symlink), or None when there is none."""
    data = safefile.read_regular(path)
    return None if data is None else data.decode("utf-8", "replace")


_TRUSTED = frozenset({0, os.geteuid()})  # root, or pvegpu's own user (a simulated node run by a user): nobody else


def _check_dir(d: str) -> None:
    """Refuse a snippets directory a user other than root could change: the guard in it runs as root at every start.

    It must be a real directory (not reached through a symlink), owned by root, not writable by group or others;
    every directory above it must be root's too, or sticky (``/tmp``), so nobody can swap it for another.
    """
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{d} is a symbolic link or not a directory; pvegpu writes snippets only into a real directory",
                         f"make {d} a plain directory owned by root")
    if st.st_uid not in _TRUSTED or st.st_mode & 0o022:
        raise UsageError(f"{d} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: a user other than root could swap the "
                         "guard that runs as root", f"chown root:root {d} && chmod 755 {d}")
    up = os.path.dirname(os.path.abspath(d))
    while True:
        a = os.stat(up)
        if (a.st_uid not in _TRUSTED or a.st_mode & 0o022) and not (a.st_uid == 0 and a.st_mode & stat.S_ISVTX):
            raise UsageError(f"{up} (above {d}) can be changed by uid {a.st_uid} or its group/others: the snippets directory could be swapped",
                             f"chown root:root {up} && chmod go-w {up}")
        if up == os.path.dirname(up):
            return
        up = os.path.dirname(up)


_PATH_LINES = re.compile(r"^(PVEGPU|PVEGPU_PYTHON|PVEGPU_PYTHONPATH)=.*$", re.M)  # filled in by guard_text, per install


def guard_problem(path: str, expected: str) -> str | None:
    """Why the file at ``path`` is not a guard pvegpu wrote (None when it is): a regular file, not a symlink, owned
    by root, not writable by group or others, with the template's text (its three install paths aside)."""
    try:
        st = os.lstat(path)
    except OSError:
        return f"{path} is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a symlink?)"
    if st.st_uid not in _TRUSTED or st.st_mode & 0o022:
        return f"{path} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: not the guard pvegpu wrote"
    text = read_nofollow(path)
    if text is None or _PATH_LINES.sub(r"\1=", text) != _PATH_LINES.sub(r"\1=", expected):
        return f"{path} is not the guard pvegpu wrote (its text was changed): run `pvegpu hook install` again"
    return None


def template() -> str:
    """The guard shipped in contrib/hookscripts (or its copy inside the package)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pvegpu/
    for path in (os.path.join(os.path.dirname(package), "contrib", "hookscripts", GUARD), os.path.join(package, "data", GUARD)):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    raise PvegpuError("the guard hookscript template is missing from this installation", "reinstall pvegpu")


@dataclass
class Plan:
    """What install/uninstall did or would do, and what needs the admin."""

    done: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused


_ct_confs = ct_confs  # the one /etc/pve reader (adapters/etcpve.py)


class StorageHung(PvegpuError):
    """A storage's files did not answer within the deadline (a dead NFS/CIFS server, a hung FUSE mount)."""

    exit_code = E.EXIT_AUDIT_ATTENTION

    def __init__(self, storage: str, path: str, deadline: float) -> None:
        super().__init__(f"storage {storage} ({path}) did not answer within {deadline:g} s",
                         f"is it a dead network mount? `pvesm status`, `findmnt {path}`")
        self.storage = storage


def _on_storage(st: Storage, deadline: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, every filesystem probe of storage ``st``, in a forked child under ``deadline`` seconds
    (``call_in_child``): a dead network mount hangs that child, never pvegpu nor the package upgrade that runs it.
    ``fn``'s answer must be JSON-able; an OSError or PvegpuError it raises is raised here again; StorageHung when
    it did not answer in time (what it was doing may or may not have happened)."""

    def child() -> dict[str, Any]:
        try:
            return {"value": fn(*args)}
        except OSError as exc:
            return {"oserror": [exc.errno, exc.strerror or str(exc), exc.filename]}

    finished, answer = call_in_child(child, deadline)
    if not finished:
        raise StorageHung(st.name, st.path, deadline)
    if answer is None or "ok" not in answer:
        if answer is not None and isinstance(answer.get("error"), dict):
            raise PvegpuError.from_json(answer["error"])
        raise PvegpuError(f"checking storage {st.name} ({st.path}) failed: {(answer or {}).get('crash')}", "run it again")
    out = answer["ok"]
    if "oserror" in out:
        errno, strerror, filename = out["oserror"]
        raise OSError(errno, strerror, filename) if filename is not None else OSError(errno, strerror)
    return out["value"]


def _is_ours(volid: str | None, storage: str | None = None) -> bool:
    """pvegpu's guard or one of its chain scripts, on ``storage`` (None: on any storage)."""
    if not volid or ":" not in volid:
        return False
    where, _, name = str(volid).partition(":")
    return (storage is None or where == storage) and (name == f"snippets/{GUARD}" or name.startswith(f"snippets/{GUARD}-chain-"))


def _snippet_path(storage: Storage, volid: str) -> str:
    return os.path.join(storage.path, "snippets", volid.split("snippets/", 1)[-1])


def _check_nodes(pve_root: str, local: str, names: set[str], lister: SnippetLister | None, plan: Plan) -> None:
    for n in node_names(pve_root):
        if n == local:
            continue
        have = lister(n) if lister else None
        missing = sorted(names - have) if have is not None else None
        if missing is None:
            plan.warnings.append(f"node {n}: cannot tell whether the snippet(s) exist there (no API); a CT moved there "
                                 f"will not start without them: copy them (`scp /var/lib/vz/snippets/{GUARD}* root@{n}:/var/lib/vz/snippets/`)")
        elif missing:
            plan.warnings.append(f"node {n} lacks {', '.join(missing)}: containers restored or migrated there will not start; "
                                 f"`scp /var/lib/vz/snippets/{GUARD}* root@{n}:/var/lib/vz/snippets/`")


def _cause(exc: OSError) -> str:
    """An OSError as an admin reads it: ``Read-only file system (EROFS)``."""
    name = errno.errorcode.get(exc.errno or 0)
    return f"{exc.strerror or exc}" + (f" ({name})" if name else "")


def _write_fix(code: int | None, sdir: str) -> str:
    """What to do about a snippets directory that cannot be written, by its error."""
    if code == errno.EROFS:
        how = f"remount the file system of {sdir} read-write"
    elif code in (errno.ENOSPC, errno.EDQUOT):
        how = f"free space on the file system of {sdir}"
    elif code in (errno.EACCES, errno.EPERM):
        how = f"let root write {sdir} (an NFS export with root_squash? an immutable directory?)"
    else:
        how = f"make {sdir} writable"
    return f"{how}, or use another snippets storage (`pvegpu hook install --storage NAME`)"


def _put_guard(sdir: str, path: str, text: str) -> list[Any] | bool:
    """The guard written (True), already there (False), or why it cannot be written (a read-only storage, a full
    disk, root squashed on NFS): ``[errno, what failed]``; a snippets directory others could change raises UsageError."""
    made = not os.path.lexists(sdir)
    try:
        os.makedirs(sdir, mode=0o755, exist_ok=True)
    except OSError as exc:
        return [exc.errno, f"creating {sdir}: {_cause(exc)}"]
    _check_dir(sdir)
    try:
        if read_nofollow(path) != text or not os.path.isfile(path) or os.path.islink(path):
            write_atomic(path, text, 0o755)
            return True
    except OSError as exc:
        if made:  # nothing half-done: the directory made for a guard that could not be written goes too
            try:
                os.rmdir(sdir)
            except OSError:
                pass
        return [exc.errno, _cause(exc)]
    return False


def install(vmids: list[int], *, pve_root: str, node: str, storage_name: str = "local", chain: bool = False,
            run: Runner = run_command, lister: SnippetLister | None = None, guard: str | None = None,
            deadline: float = STORAGE_DEADLINE) -> Plan:
    """Install the guard snippet and set it as the hookscript of ``vmids`` (default: every GPU CT of this node).
    Every probe of a storage's files ends by ``deadline`` seconds (a storage that does not answer is refused)."""
    plan = Plan()
    st = read_storage(pve_root, storage_name)
    sdir = os.path.join(st.path, "snippets")
    path = os.path.join(sdir, GUARD)
    text = guard if guard is not None else guard_text(template())
    try:
        put = _on_storage(st, deadline, _put_guard, sdir, path, text)
    except StorageHung as exc:
        plan.refused.append(f"{exc.message}: the guard was not written and no container changed. Fix: {exc.hint}, "
                            "or use another snippets storage (`pvegpu hook install --storage NAME`)")
        return plan
    if isinstance(put, list):  # a read-only storage, a full disk: nothing is set to a guard that is not there
        code, why = put
        plan.refused.append(f"cannot write the guard to {path} (storage {st.name}): {why}; nothing changed. "
                            f"Fix: {_write_fix(code, sdir)}")
        return plan
    if put:
        plan.done.append(f"wrote {path}")
    content = st.effective_content()
    if content is None:
        plan.warnings.append(f"storage {st.name} ({st.type}) has no content line and pvegpu does not know its default: "
                             f"add snippets yourself (`pvesm set {st.name} --content <current>,snippets`)")
    elif "snippets" not in content:
        argv = ["pvesm", "set", st.name, "--content", ",".join(content + ["snippets"])]
        rc, out = run(argv)
        (plan.done if rc == 0 else plan.warnings).append(" ".join(argv) + ("" if rc == 0 else f" failed: {out}"))
    confs = _ct_confs(pve_root, node)
    targets = vmids or [v for v, (_, t) in confs.items() if (g := parse_config(t).gpus).minors or g.all_gpus]
    names = {GUARD}
    for vmid in targets:
        if vmid not in confs:
            plan.refused.append(f"CT {vmid}: no such container on node {node}")
            continue
        current = parse_config(confs[vmid][1]).hookscript
        want = f"{st.name}:snippets/{GUARD}"
        if _is_ours(current):  # on any storage: never chain pvegpu's guard onto itself
            plan.done.append(f"CT {vmid}: already guarded ({current})")
            names.add(str(current).split("snippets/", 1)[-1])
            continue
        if current and not chain:
            plan.refused.append(f"CT {vmid} already has hookscript {current}; not replaced. Chain it (pvegpu runs first, "
                                f"then yours): `pvegpu hook install {vmid} --chain`")
            continue
        if current:
            if not current.isprintable():
                plan.refused.append(f"CT {vmid}: hookscript {current!r} has control characters; not chained")
                continue
            chained = f"{GUARD}-chain-{vmid}"
            try:
                orig = _snippet_path(read_storage(pve_root, current.split(":", 1)[0]), current)
            except PvegpuError as exc:  # the admin's hookscript is on no file storage pvegpu can name: never chained blind
                plan.refused.append(f"CT {vmid}: its hookscript {current}: {exc.message}; not chained, hookscript left as it is")
                continue
            ctext = chain_text(vmid, current, path, orig)
            try:
                _on_storage(st, deadline, write_atomic, os.path.join(sdir, chained), ctext, 0o755)
            except StorageHung as exc:
                plan.refused.append(f"CT {vmid}: {exc.message}: its chain script was not written; hookscript left as it is")
                continue
            except OSError as exc:
                plan.refused.append(f"CT {vmid}: cannot write its chain script {os.path.join(sdir, chained)}: {_cause(exc)}; "
                                    f"hookscript left as it is. Fix: {_write_fix(exc.errno, sdir)}")
                continue
            want = f"{st.name}:snippets/{chained}"
            names.add(chained)
        argv = ["pct", "set", str(vmid), "--hookscript", want]
        rc, out = run(argv)
        (plan.done if rc == 0 else plan.refused).append(" ".join(argv) + ("" if rc == 0 else f" failed: {out}"))
    plan.warnings.extend(v.line() for v in ha_verdicts(pve_root, node, [v for v in targets if v in confs]) if v.flagged)
    if not st.shared:
        _check_nodes(pve_root, node, names, lister, plan)
    return plan


def chain_text(vmid: int, original: str, guard_path: str, original_path: str) -> str:
    """The chain script: the guard, then the admin's own hookscript. Paths are shell-quoted data; the original
    volid is kept verbatim on the ``# original:`` line for uninstall."""
    return (f"#!/bin/sh\n# pvegpu guard chained before the original hookscript (restored by `pvegpu hook uninstall {vmid}`)\n"
            f"# original: {original}\n{shlex.quote(guard_path)} \"$1\" \"$2\" || exit $?\n"
            f"exec {shlex.quote(original_path)} \"$1\" \"$2\"\n")


def _chained_original(cpath: str) -> str | None:
    """The original hookscript a chain script pvegpu wrote names (its ``# original:`` line)."""
    m = re.search(r"^# original: (.+)$", read_nofollow(cpath) or "", re.M)
    return m.group(1) if m else None


def _remove(path: str) -> bool:
    """Remove ``path`` (not through a symlink) if it is there; whether it was."""
    if not os.path.lexists(path):
        return False
    os.unlink(path)
    return True


def uninstall(vmids: list[int], *, pve_root: str, node: str, storage_name: str = "local", run: Runner = run_command,
              deadline: float = STORAGE_DEADLINE) -> Plan:
    """Take the guard off ``vmids`` (default: every guarded CT of this node); restore chained originals;
    delete the snippet once no guest in the cluster (container or VM) refers to it. Every probe of a storage's
    files ends by ``deadline`` seconds: what a storage that does not answer holds is left as it is, and said."""
    plan = Plan()
    st = read_storage(pve_root, storage_name)
    confs = _ct_confs(pve_root, node)
    targets = vmids or [v for v, (_, t) in confs.items() if _is_ours(parse_config(t).hookscript)]
    for vmid in targets:
        current = parse_config(confs.get(vmid, ("", ""))[1]).hookscript
        if not _is_ours(current):
            plan.refused.append(f"CT {vmid}: hookscript is {current or 'not set'}, not pvegpu's; left alone")
            continue
        argv = ["pct", "set", str(vmid), "--delete", "hookscript"]
        cst = read_storage(pve_root, str(current).split(":", 1)[0])
        cpath = _snippet_path(cst, str(current))  # where the CT's volid points
        if "-chain-" in str(current):
            try:
                original = _on_storage(cst, deadline, _chained_original, cpath)
            except StorageHung as exc:  # its original hookscript cannot be read: never drop it unread
                plan.refused.append(f"CT {vmid}: {exc.message}: its chain script cannot be read; hookscript left as it is")
                continue
            if original:
                argv = ["pct", "set", str(vmid), "--hookscript", original]
        rc, out = run(argv)
        (plan.done if rc == 0 else plan.refused).append(" ".join(argv) + ("" if rc == 0 else f" failed: {out}"))
        if rc == 0 and "-chain-" in str(current):
            try:
                if _on_storage(cst, deadline, _remove, cpath):
                    plan.done.append(f"removed {cpath}")
            except StorageHung as exc:
                plan.warnings.append(f"{cpath} not removed: {exc.message}")
            except OSError as exc:  # a read-only storage: the CT is unguarded, its unused chain script stays
                plan.warnings.append(f"{cpath} not removed: {_cause(exc)}")
    # the guard stays while any container or VM uses it, directly or through its chain script
    still = [f"CT {v}" for v, (_, t) in _ct_confs(pve_root).items() if _is_ours(parse_config(t).hookscript, st.name)]
    still += [f"VM {v}" for v, (_, t) in vm_confs(pve_root).items() if _is_ours(parse_config(t).hookscript, st.name)]
    path = os.path.join(st.path, "snippets", GUARD)
    if not still and plan.ok:
        try:
            if _on_storage(st, deadline, _remove, path):
                plan.done.append(f"removed {path}")
        except StorageHung as exc:
            plan.warnings.append(f"{path} not removed: {exc.message}")
        except OSError as exc:
            plan.warnings.append(f"{path} not removed: {_cause(exc)}")
    elif still:
        plan.warnings.append(f"{path} kept: still used by {', '.join(still)}")
    return plan


def ha_verdicts(pve_root: str, node: str, vmids: list[int]) -> list[HaVerdict]:
    """What HA would do with each of ``vmids`` after a start the gate refuses (``core.ha``; unknown when its files
    cannot be read)."""
    files = ha_files(pve_root)
    return [judge(vmid, node, files) for vmid in vmids]


class GuardState(enum.StrEnum):
    GUARDED = "guarded"
    SWAPPED = "not guarded: guard changed"  # the hookscript names pvegpu's guard, but the file is not what pvegpu wrote
    OTHER = "other hookscript"
    UNGUARDED = "unguarded"
    UNKNOWN = "unknown: storage not answering"  # its guard's storage did not answer in time: never called guarded


@dataclass(frozen=True)
class GuardRow:
    vmid: int
    state: GuardState
    hookscript: str | None


NOT_INSTALLED = ("the start gate is not installed on this node (no guest here runs pvegpu's guard, no guard snippet): "
                 "nothing to check; `pvegpu hook install` puts it on")


@dataclass
class GuardStatus:
    """``pvegpu hook status``: GPU containers of this node and whether the guard is on them.

    ``installed`` False: the gate is not on this node at all, as after ``pvegpu hook uninstall`` (or before any
    ``hook install``): no container or VM of this node has pvegpu's guard (or a chain script) as its hookscript, and
    this node's snippets storage holds no guard. That is the admin's choice, not a problem: exit 0, the GPU
    containers still listed as unguarded, and ``notes`` says so. Anything in between (one guest guarded and another
    not, a guard snippet no guest uses yet, a guest naming a guard that is missing) is a problem: exit 8."""

    node: str
    containers: list[GuardRow]
    problems: list[str]
    installed: bool = True
    notes: list[str] = field(default_factory=list)
    ha: list[HaVerdict] = field(default_factory=list)  # the guarded containers HA manages (or whose HA state is unknown)

    @property
    def ok(self) -> bool:
        return not self.installed or (not self.problems and all(r.state is GuardState.GUARDED for r in self.containers))

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "installed": self.installed, "problems": self.problems,
                "containers": [{"vmid": r.vmid, "state": r.state.value, "hookscript": r.hookscript} for r in self.containers],
                "ha": [v.to_json() for v in self.ha]}


def status(*, pve_root: str, node: str, storage_name: str = "local", lister: SnippetLister | None = None,
           guard: str | None = None, deadline: float = STORAGE_DEADLINE) -> GuardStatus:
    """Guarded / unguarded GPU containers of this node, and nodes missing the snippet. A container is guarded only
    when the files its hookscript runs (the guard, or a chain script and the guard) are the ones pvegpu wrote; one
    whose storage does not answer within ``deadline`` seconds is unknown."""
    st = read_storage(pve_root, storage_name)
    expected = guard if guard is not None else guard_text(template())
    rows = []
    plan = Plan()
    confs = _ct_confs(pve_root, node)
    in_use = any(_is_ours(parse_config(t).hookscript) for _, t in [*confs.values(), *vm_confs(pve_root, node).values()])
    for vmid, (_, text) in confs.items():
        conf = parse_config(text)
        if not (conf.gpus.minors or conf.gpus.all_gpus):
            continue
        hs = conf.hookscript
        state = GuardState.GUARDED if _is_ours(hs) else (GuardState.OTHER if hs else GuardState.UNGUARDED)
        if state is GuardState.GUARDED:
            try:
                why = _bounded_swapped(pve_root, vmid, str(hs), expected, deadline)
            except StorageHung as exc:
                state, why = GuardState.UNKNOWN, f"{exc.message}: its guard cannot be checked"
            if why is not None:
                state = GuardState.SWAPPED if state is GuardState.GUARDED else state
                plan.warnings.append(f"CT {vmid}: {why}")
        rows.append(GuardRow(vmid, state, hs))
    local = os.path.join(st.path, "snippets", GUARD)
    try:
        there, runs = _on_storage(st, deadline, _snippet_state, local)
    except StorageHung as exc:
        there = runs = None
        plan.warnings.append(f"this node ({node}): {exc.message}: whether {local} is there is unknown")
    if not in_use and there is False:  # taken off (`hook uninstall`) or never put on: nothing to report
        return GuardStatus(node, rows, [], installed=False, notes=[NOT_INSTALLED])
    if there is not None and not runs:
        plan.warnings.append(f"this node ({node}) lacks an executable {local}")
    if not st.shared:
        _check_nodes(pve_root, node, {GUARD}, lister, plan)
    ha = [v for v in ha_verdicts(pve_root, node, [r.vmid for r in rows if r.state is GuardState.GUARDED]) if v.managed is not False]
    plan.warnings.extend(v.line() for v in ha if v.flagged)
    return GuardStatus(node, rows, plan.warnings, ha=ha)


def _snippet_state(path: str) -> list[bool]:
    """[whether anything is at ``path`` (a link too), whether it is executable]."""
    return [os.path.lexists(path), os.access(path, os.X_OK)]


def _bounded_swapped(pve_root: str, vmid: int, volid: str, expected: str, deadline: float) -> str | None:
    """``_swapped``, its file probes in a child under ``deadline`` (StorageHung names the hookscript's storage)."""
    try:
        st = read_storage(pve_root, volid.split(":", 1)[0])
    except PvegpuError as exc:
        return f"its hookscript's storage cannot be read: {exc.message}"
    return _on_storage(st, deadline, _swapped, pve_root, vmid, volid, expected)


def _swapped(pve_root: str, vmid: int, volid: str, expected: str) -> str | None:
    """Why the guard a CT's hookscript runs is not pvegpu's (None when it is)."""
    try:
        path = _snippet_path(read_storage(pve_root, volid.split(":", 1)[0]), volid)
    except PvegpuError as exc:
        return f"its hookscript's storage cannot be read: {exc.message}"
    guard_path = os.path.join(os.path.dirname(path), GUARD)
    if "-chain-" in volid:
        text = read_nofollow(path) or ""
        m = re.search(r"^# original: (.+)$", text, re.M)
        if m is None:
            return f"{path} is not a chain script pvegpu wrote"
        try:
            orig = _snippet_path(read_storage(pve_root, m.group(1).split(":", 1)[0]), m.group(1))
        except PvegpuError:
            return f"{path}: the chained hookscript's storage cannot be read"
        want = chain_text(vmid, m.group(1), guard_path, orig)
        lst = os.lstat(path)
        if text != want or lst.st_uid not in _TRUSTED or lst.st_mode & 0o022 or not stat.S_ISREG(lst.st_mode):
            return f"{path} is not the chain script pvegpu wrote (changed, or writable by others)"
    return guard_problem(guard_path, expected)


_GUARD_MARK = "# pvegpu start gate for Proxmox VE containers"  # the guard's second line, in every version pvegpu wrote


def _refresh_one(path: str, text: str) -> tuple[str, str] | None:
    """Rewrite the guard at ``path`` if pvegpu wrote it: (``done`` | ``warnings`` | ``refused``, what happened),
    or None when there is nothing to do."""
    if not os.path.lexists(path):
        return None
    lst = os.lstat(path)
    old = read_nofollow(path)
    if (not stat.S_ISREG(lst.st_mode) or lst.st_uid not in _TRUSTED or lst.st_mode & 0o022 or old is None
            or not (old.split("\n")[1:2] or [""])[0].startswith(_GUARD_MARK)):
        return "warnings", f"{path} left alone: not a guard pvegpu wrote (`pvegpu hook status` says more)"
    if old == text:
        return None
    try:
        write_atomic(path, text, 0o755)
    except (OSError, PvegpuError) as exc:
        return "refused", f"cannot rewrite {path}: {getattr(exc, 'strerror', None) or exc}; run `pvegpu hook install VMID` for its containers"
    return "done", f"rewrote {path} for this pvegpu"


def refresh(pve_root: str, deadline: float = STORAGE_DEADLINE) -> Plan:
    """Rewrite every guard snippet an earlier pvegpu wrote so that it runs this installation (its paths, its text);
    no container is changed. Run by the package's postinst: after an upgrade, and after a PVE major upgrade whose
    new Python moved the venv's site-packages, the guard's fast path names this build again.

    Only a regular file at ``<storage>/snippets/pvegpu-guard`` that root (or this user) owns, that no group or other
    may write, and that begins like a guard pvegpu wrote is rewritten (what ``hook install`` would write there);
    anything else is left alone and named. Storages: ``local`` and every storage a container's or VM's hookscript
    names. Each storage's files are probed in a child under ``deadline`` seconds: one that does not answer (a dead
    NFS/CIFS mount) is named in a warning and its guard left as it is; the others are still refreshed.
    """
    plan = Plan()
    names = {"local"}
    for _n, (_node, text) in [*_ct_confs(pve_root).items(), *vm_confs(pve_root).items()]:
        hs = parse_config(text).hookscript
        if _is_ours(hs):
            names.add(str(hs).split(":", 1)[0])
    text = guard_text(template())
    for name in sorted(names):
        try:
            st = read_storage(pve_root, name)
        except PvegpuError as exc:
            plan.warnings.append(f"storage {name}: {exc.message}")
            continue
        path = os.path.join(st.path, "snippets", GUARD)
        try:
            got = _on_storage(st, deadline, _refresh_one, path, text)
        except StorageHung as exc:  # never fails the upgrade: said, and that guard left as it is
            plan.warnings.append(f"{exc.message}: its guard ({path}) was not checked and is left as it is")
            continue
        except (OSError, PvegpuError) as exc:
            plan.warnings.append(f"storage {name}: {getattr(exc, 'strerror', None) or exc}: its guard ({path}) was not checked")
            continue
        if got:
            getattr(plan, got[0]).append(got[1])
    return plan


def postinst_refresh(pve_root: str = "/etc/pve", err: TextIO | None = None) -> int:
    """The package's postinst (``packaging/debian/postinst``): ``refresh``, each line said on ``err`` (stderr) as
    ``pvegpu: ...`` through the one escaper, since a storage's path comes from ``storage.cfg`` and may hold escape
    sequences that apt's terminal must never see raw; 0 when nothing was refused, else 1; never a traceback."""
    err = err or sys.stderr
    try:
        plan = refresh(pve_root)
    except Exception as exc:  # noqa: BLE001 - one line in apt's output, never a traceback
        print(f"pvegpu: {type(exc).__name__}: {escape(str(exc))}", file=err)
        return 1
    for line in plan.done + plan.warnings + plan.refused:
        print(f"pvegpu: {escape(line)}", file=err)
    return 0 if plan.ok else 1
