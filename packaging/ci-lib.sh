# CI's shell helpers, sourced (not run) by packaging/ci-deb and packaging/ci-user-run; one home for each:
#   readme_command demo|test   the README's set-up command, verbatim (the line of its "Try it" section)
#   timed LABEL CMD...         run, then print "time: LABEL N s"
#   ci_init NAME               as root with debootstrap: the work directory $W (/var/tmp/pvegpu-NAME.XXXXXX) and the
#                              traps that unmount every chroot mount and remove $W at exit, also on failure or a signal
#   make_base RELEASE DIR      a debootstrap minbase chroot of RELEASE
#   mount_in CH / umount_in CH /proc, /sys, /dev, /dev/pts, /dev/shm and /run of a chroot; its resolver and pip's CA;
#                              umount_in fails when a process was left running there (killed, named)
#   run_in CH SCRIPT           SCRIPT run by bash -euo pipefail as root inside the chroot, in a clean environment
# The sourcing script sets CI_NAME (the prefix of its messages) before calling fail.
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
MOUNTS=()
W=""

fail() { echo "${CI_NAME:-ci} FAILED: $*" >&2; exit 1; }

readme_command() {  # the README's demo or test set-up command, exactly one line of it
    local src readme got
    src=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    readme=$src/README.md
    case $1 in
    demo) got=$(sed -n 's/^    \(.*apt-get install.*pvegpu demo\)$/\1/p' "$readme") ;;
    test) got=$(sed -n 's/^    \(.*apt-get install.*pytest.*\)$/\1/p' "$readme") ;;
    *) fail "readme_command demo|test, not '$1'" ;;
    esac
    [ -n "$got" ] && [ "$(printf '%s\n' "$got" | wc -l)" = 1 ] || fail "README.md has no single $1 set-up command"
    printf '%s\n' "$got"
}

timed() {  # timed LABEL CMD...: run, then print how long it took
    local label=$1 t=$SECONDS
    shift
    "$@"
    echo "time: $label $((SECONDS - t)) s" >&2
}

procs_in() {  # procs_in DIR: "PID COMMAND" of each process whose root is DIR or under it (in a chroot there)
    local p r
    for p in /proc/[0-9]*; do
        r=$(readlink "$p/root" 2>/dev/null) || continue
        case $r in "$1" | "$1"/*) printf '%s %s\n' "${p#/proc/}" "$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null | cut -c1-200)" ;; esac
    done
}

# end_procs DIR: wait up to 10 s for what still runs in the chroot(s) at DIR to end; what stays is named and
# killed (a chroot's mounts cannot go while a process uses them). Returns 1 when something had to be killed.
end_procs() {
    local left i
    for ((i = 0; i < 20; i++)); do left=$(procs_in "$1"); [ -z "$left" ] && return 0; sleep 0.5; done
    printf '%s\n' "$left" | sed "s/^/${CI_NAME:-ci}: left running in a chroot, killed: pid /" >&2
    kill -KILL $(printf '%s\n' "$left" | cut -d' ' -f1) 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do [ -z "$(procs_in "$1")" ] && break; sleep 0.5; done
    return 1
}

ci_cleanup() {
    local i
    if [ -n "$W" ]; then end_procs "$W" || true; fi
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTS[i]}" 2>/dev/null || true; done
    if [ -n "$W" ]; then rm -rf --one-file-system "$W"; fi
}

ci_init() {
    CI_NAME=$1
    [ "$(id -u)" = 0 ] || { echo "$CI_NAME: run as root" >&2; exit 2; }
    command -v debootstrap >/dev/null || { echo "$CI_NAME: apt-get install -y debootstrap" >&2; exit 2; }
    W=$(mktemp -d "/var/tmp/pvegpu-$CI_NAME.XXXXXX")
    W=$(cd "$W" && pwd -P)  # as /proc/PID/root names it
    trap ci_cleanup EXIT
    trap 'exit 130' INT TERM HUP
}

make_base() {
    local log=$W/$1-debootstrap.log
    debootstrap --variant=minbase "$1" "$2" "$MIRROR" >"$log" 2>&1 || { tail -20 "$log" >&2; fail "debootstrap $1"; }
}

# The chroot is a (private) mount of its own, as a system's / is: in a chroot, /proc/self/mountinfo lists only the
# mounts under its root, so without it no mount holds the chroot's files and their file system is unknown. The binds
# of /dev are slaves: what is mounted in the chroot (its /dev/shm) never shows on the host.
# pip in the chroot, for root and for any user there: the index and the CA bundle of the caller's pip (a mirror, a
# TLS-inspecting proxy) in the chroot's /etc/pip.conf
mount_in() {
    local ch=$1
    mount --bind "$ch" "$ch"; MOUNTS+=("$ch"); mount --make-private "$ch"
    mount -t proc proc "$ch/proc"; MOUNTS+=("$ch/proc")
    mount -t sysfs sysfs "$ch/sys"; MOUNTS+=("$ch/sys")
    mount --bind /dev "$ch/dev"; MOUNTS+=("$ch/dev"); mount --make-slave "$ch/dev"
    mount --bind /dev/pts "$ch/dev/pts"; MOUNTS+=("$ch/dev/pts"); mount --make-slave "$ch/dev/pts"
    mkdir -p "$ch/dev/shm"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$ch/dev/shm"; MOUNTS+=("$ch/dev/shm")
    mount -t tmpfs -o mode=755 tmpfs "$ch/run"; MOUNTS+=("$ch/run")
    cp -L /etc/resolv.conf "$ch/etc/resolv.conf"
    if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ] || [ -n "${PIP_INDEX_URL:-}" ]; then
        {
            echo "[global]"
            if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then cp -L "$PIP_CERT" "$ch/etc/ci-pip-ca.pem"; echo "cert = /etc/ci-pip-ca.pem"; fi
            if [ -n "${PIP_INDEX_URL:-}" ]; then echo "index-url = $PIP_INDEX_URL"; fi
        } >"$ch/etc/pip.conf"
    fi
}

umount_in() {  # a step that left a process running in the chroot fails (named), after the chroot is unmounted
    local ch=$1 m i keep=() left=0
    end_procs "$ch" || left=1
    for m in run dev/shm dev/pts dev sys proc; do umount "$ch/$m"; done
    umount "$ch"
    for i in "${MOUNTS[@]}"; do case "$i" in "$ch" | "$ch"/*) ;; *) keep+=("$i") ;; esac; done
    MOUNTS=("${keep[@]}")
    [ "$left" = 0 ] || fail "processes were left running in $ch (named above)"
}

run_in() {
    chroot "$1" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        LC_ALL=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive bash -euo pipefail -c "$2"
}
