"""`pvegpu hook install | uninstall | status`: put the start gate on containers, take it off, report.

Manual equivalent: copy the guard to ``/var/lib/vz/snippets/``, ``pvesm set local --content ...,snippets``,
``pct set 129 --hookscript local:snippets/pvegpu-guard`` (root@pam only: API tokens cannot set hookscripts),
and the same file on every node the container may start on (a missing snippet stops restores and migrations
from starting).
"""

from __future__ import annotations

import enum
import importlib.util
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable

from .adapters import safefile
from .adapters.etcpve import ct_confs, node_names, vm_confs
from .adapters.storagecfg import Storage, read_storage
from .errors import PvegpuError, UsageError
from .lxcconf import parse_config
from .record import field, record

GUARD = "pvegpu-guard"
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
    if fast:  # the gate needs pvegpu only (it reads NVML through ctypes): one directory on the path
        spec = importlib.util.find_spec("pvegpu")
        where = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else ""
        if where and ":" not in where:
            text = text.replace("PVEGPU_PYTHON=\n", f"PVEGPU_PYTHON={shlex.quote(sys.executable)}\n")
            text = text.replace("PVEGPU_PYTHONPATH=\n", f"PVEGPU_PYTHONPATH={shlex.quote(where)}\n")
    return text


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
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(os.path.dirname(here), "contrib", "hookscripts", GUARD), os.path.join(here, "data", GUARD)):
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    raise PvegpuError("the guard hookscript template is missing from this installation", "reinstall pvegpu")


def run_command(argv: list[str]) -> tuple[int, str]:
    """Run a PVE CLI command (``pct``, ``pvesm``) with a deadline; (exit code, combined output)."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found (is this a Proxmox VE node?)"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)}: no answer within 60 s"
    return p.returncode, (p.stdout + p.stderr).strip()


@record
class Plan:
    """What install/uninstall did or would do, and what needs the admin."""

    done: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.refused


_ct_confs = ct_confs  # the one /etc/pve reader (adapters/etcpve.py)


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


def install(vmids: list[int], *, pve_root: str, node: str, storage_name: str = "local", chain: bool = False,
            run: Runner = run_command, lister: SnippetLister | None = None, guard: str | None = None) -> Plan:
    """Install the guard snippet and set it as the hookscript of ``vmids`` (default: every GPU CT of this node)."""
    plan = Plan()
    st = read_storage(pve_root, storage_name)
    sdir = os.path.join(st.path, "snippets")
    os.makedirs(sdir, mode=0o755, exist_ok=True)
    _check_dir(sdir)
    path = os.path.join(sdir, GUARD)
    text = guard if guard is not None else guard_text(template())
    try:
        os.makedirs(sdir, mode=0o755, exist_ok=True)
        if read_nofollow(path) != text or not os.path.isfile(path) or os.path.islink(path):
            write_atomic(path, text, 0o755)
            plan.done.append(f"wrote {path}")
    except OSError as exc:  # a read-only storage, a full disk: nothing is set to a guard that is not there
        plan.refused.append(f"cannot write the guard to {path} (storage {st.name}): {exc.strerror or exc}; no container changed. "
                            f"Fix: use a writable snippets storage (`pvegpu hook install --storage NAME`) or make {sdir} writable")
        return plan
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
            orig = _snippet_path(read_storage(pve_root, current.split(":", 1)[0]), current)
            write_atomic(os.path.join(sdir, chained), chain_text(vmid, current, path, orig), 0o755)
            want = f"{st.name}:snippets/{chained}"
            names.add(chained)
        argv = ["pct", "set", str(vmid), "--hookscript", want]
        rc, out = run(argv)
        (plan.done if rc == 0 else plan.refused).append(" ".join(argv) + ("" if rc == 0 else f" failed: {out}"))
    if not st.shared:
        _check_nodes(pve_root, node, names, lister, plan)
    return plan


def chain_text(vmid: int, original: str, guard_path: str, original_path: str) -> str:
    """The chain script: the guard, then the admin's own hookscript. Paths are shell-quoted data; the original
    volid is kept verbatim on the ``# original:`` line for uninstall."""
    return (f"#!/bin/sh\n# pvegpu guard chained before the original hookscript (restored by `pvegpu hook uninstall {vmid}`)\n"
            f"# original: {original}\n{shlex.quote(guard_path)} \"$1\" \"$2\" || exit $?\n"
            f"exec {shlex.quote(original_path)} \"$1\" \"$2\"\n")


def uninstall(vmids: list[int], *, pve_root: str, node: str, storage_name: str = "local", run: Runner = run_command) -> Plan:
    """Take the guard off ``vmids`` (default: every guarded CT of this node); restore chained originals;
    delete the snippet once no guest in the cluster (container or VM) refers to it."""
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
        cpath = _snippet_path(read_storage(pve_root, str(current).split(":", 1)[0]), str(current))  # where the CT's volid points
        if "-chain-" in str(current):
            m = re.search(r"^# original: (.+)$", read_nofollow(cpath) or "", re.M)
            if m:
                argv = ["pct", "set", str(vmid), "--hookscript", m.group(1)]
        rc, out = run(argv)
        (plan.done if rc == 0 else plan.refused).append(" ".join(argv) + ("" if rc == 0 else f" failed: {out}"))
        if rc == 0 and "-chain-" in str(current) and os.path.lexists(cpath):
            os.unlink(cpath)
            plan.done.append(f"removed {cpath}")
    # the guard stays while any container or VM uses it, directly or through its chain script
    still = [f"CT {v}" for v, (_, t) in _ct_confs(pve_root).items() if _is_ours(parse_config(t).hookscript, st.name)]
    still += [f"VM {v}" for v, (_, t) in vm_confs(pve_root).items() if _is_ours(parse_config(t).hookscript, st.name)]
    path = os.path.join(st.path, "snippets", GUARD)
    if os.path.lexists(path) and not still and plan.ok:
        os.unlink(path)
        plan.done.append(f"removed {path}")
    elif still:
        plan.warnings.append(f"{path} kept: still used by {', '.join(still)}")
    return plan


class GuardState(enum.StrEnum):
    GUARDED = "guarded"
    SWAPPED = "not guarded: guard changed"  # the hookscript names pvegpu's guard, but the file is not what pvegpu wrote
    OTHER = "other hookscript"
    UNGUARDED = "unguarded"


@record(frozen=True)
class GuardRow:
    vmid: int
    state: GuardState
    hookscript: str | None


@record
class GuardStatus:
    """``pvegpu hook status``: GPU containers of this node and whether the guard is on them."""

    node: str
    containers: list[GuardRow]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.state is GuardState.GUARDED for r in self.containers)

    def to_json(self) -> dict[str, object]:
        return {"node": self.node, "problems": self.problems,
                "containers": [{"vmid": r.vmid, "state": r.state.value, "hookscript": r.hookscript} for r in self.containers]}


def status(*, pve_root: str, node: str, storage_name: str = "local", lister: SnippetLister | None = None,
           guard: str | None = None) -> GuardStatus:
    """Guarded / unguarded GPU containers of this node, and nodes missing the snippet. A container is guarded only
    when the files its hookscript runs (the guard, or a chain script and the guard) are the ones pvegpu wrote."""
    st = read_storage(pve_root, storage_name)
    expected = guard if guard is not None else guard_text(template())
    rows = []
    plan = Plan()
    for vmid, (_, text) in _ct_confs(pve_root, node).items():
        conf = parse_config(text)
        if not (conf.gpus.minors or conf.gpus.all_gpus):
            continue
        hs = conf.hookscript
        state = GuardState.GUARDED if _is_ours(hs) else (GuardState.OTHER if hs else GuardState.UNGUARDED)
        if state is GuardState.GUARDED and (why := _swapped(pve_root, vmid, str(hs), expected)) is not None:
            state = GuardState.SWAPPED
            plan.warnings.append(f"CT {vmid}: {why}")
        rows.append(GuardRow(vmid, state, hs))
    local = os.path.join(st.path, "snippets", GUARD)
    if not os.access(local, os.X_OK):
        plan.warnings.append(f"this node ({node}) lacks an executable {local}")
    if not st.shared:
        _check_nodes(pve_root, node, {GUARD}, lister, plan)
    return GuardStatus(node, rows, plan.warnings)


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


def refresh(pve_root: str) -> Plan:
    """Rewrite every guard snippet an earlier pvegpu wrote so that it runs this installation (its paths, its text);
    no container is changed. Run by the package's postinst: after an upgrade, and after a PVE major upgrade whose
    new Python moved the venv's site-packages, the guard's fast path names this build again.

    Only a regular file at ``<storage>/snippets/pvegpu-guard`` that root (or this user) owns, that no group or other
    may write, and that begins like a guard pvegpu wrote is rewritten (what ``hook install`` would write there);
    anything else is left alone and named. Storages: ``local`` and every storage a container's or VM's hookscript
    names.
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
        if not os.path.lexists(path):
            continue
        lst = os.lstat(path)
        old = read_nofollow(path)
        if (not stat.S_ISREG(lst.st_mode) or lst.st_uid not in _TRUSTED or lst.st_mode & 0o022 or old is None
                or not (old.split("\n")[1:2] or [""])[0].startswith(_GUARD_MARK)):
            plan.warnings.append(f"{path} left alone: not a guard pvegpu wrote (`pvegpu hook status` says more)")
            continue
        if old == text:
            continue
        try:
            write_atomic(path, text, 0o755)
        except (OSError, PvegpuError) as exc:
            plan.refused.append(f"cannot rewrite {path}: {getattr(exc, 'strerror', None) or exc}; run `pvegpu hook install VMID` for its containers")
            continue
        plan.done.append(f"rewrote {path} for this pvegpu")
    return plan
