"""Driver consistency: the NVIDIA user-space libraries inside a container against the host's kernel module (pure).

A container gets the GPU through the host's kernel module and its own copy of the user-space libraries (installed
with ``--no-kernel-module``, the usual LXC recipe). After the host's driver is upgraded, a container whose libraries
are of another version fails its next CUDA start with "Driver/library version mismatch"; it looks healthy until then.
The versions are read from file names only (``libnvidia-ml.so.550.54.15``, ``libcuda.so.550.54.15``): nothing in the
container is opened or run. What cannot be read is unknown, never a mismatch.

Manual equivalent: ``cat /proc/driver/nvidia/version``; ``pct exec 129 -- ls /usr/lib/x86_64-linux-gnu | grep -e
libcuda.so. -e libnvidia-ml.so.``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

LIBS = ("libnvidia-ml.so.", "libcuda.so.")  # the driver's own libraries: their version is the driver's
# the usual lib directories, and Debian's packaged driver (libcuda1, libnvidia-ml1: ``<multiarch>/nvidia/current``)
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib", "lib/x86_64-linux-gnu", "lib64", "usr/lib/aarch64-linux-gnu",
            "usr/lib/x86_64-linux-gnu/nvidia/current", "usr/lib/aarch64-linux-gnu/nvidia/current")


def _version(text: str) -> str | None:
    """``550.54.15`` when ``text`` is a driver version (digits and dots, two parts at least), else None."""
    parts = text.split(".")
    return text if len(parts) >= 2 and all(p.isdecimal() and p.isascii() for p in parts) else None


def kernel_version(text: str) -> str | None:
    """The version in ``/proc/driver/nvidia/version`` ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ...",
    or "... Open Kernel Module for x86_64  550.54.15 ..."); None when it names none."""
    for line in text.splitlines():
        if line.startswith("NVRM version:") and "Kernel Module" in line:
            for word in line.split("Kernel Module", 1)[1].split():
                if (v := _version(word)) is not None:
                    return v
    return None


SHOWN = 8  # versions a check names: a tenant can give its lib directories thousands of file names


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def listing(versions: frozenset[str], host: str | None) -> list[str]:
    """At most ``SHOWN`` of ``versions``, in version order, the host's among them when present: what a flag and the JSON
    name stays a line however many file names a tenant makes."""
    keep = [host] if host is not None and host in versions else []
    others = sorted((v for v in versions if v != host), key=_key)
    return sorted(keep + others[:SHOWN - len(keep)], key=_key)


def lib_versions(names: list[str]) -> frozenset[str]:
    """The driver versions the file names of a library directory carry (``libcuda.so.1`` names none)."""
    out: set[str] = set()
    for name in names:
        for lib in LIBS:
            if name.startswith(lib) and (v := _version(name[len(lib):])) is not None:
                out.add(v)
    return frozenset(out)


class DriverMatch(StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    UNKNOWN = "unknown"  # the host's version or the container's libraries could not be read, or none were found


@dataclass(frozen=True)
class DriverCheck:
    """One running GPU container's libraries against the host's kernel module."""

    host: str | None
    container: frozenset[str] | None  # None: its root could not be read
    why_unknown: str | None = None

    @property
    def state(self) -> DriverMatch:
        if self.host is None or not self.container:
            return DriverMatch.UNKNOWN
        return DriverMatch.MATCH if self.container == {self.host} else DriverMatch.MISMATCH

    def to_json(self) -> dict[str, object]:
        return {"state": self.state.value, "host": self.host, "container": listing(self.container or frozenset(), self.host),
                "why_unknown": self.why_unknown if self.state is DriverMatch.UNKNOWN else None}

    def named(self) -> str:
        """The container's versions for a person: ``listing``'s, and how many more there are."""
        shown = listing(self.container or frozenset(), self.host)
        more = len(self.container or ()) - len(shown)
        return ", ".join(shown) + (f" (+{more} more)" if more else "")

    def fix(self, vmid: int) -> str:
        return (f"install the host's driver {self.host} user space in CT {vmid}: `pct push {vmid} NVIDIA-Linux-x86_64-{self.host}.run "
                f"/root/nvidia.run && pct exec {vmid} -- sh /root/nvidia.run --no-kernel-module --silent`, then restart its CUDA jobs")
