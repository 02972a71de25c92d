"""The sandbox's seccomp filter (libseccomp through ctypes): everything allowed but the
system calls sandboxed code has no use for and that widen the kernel's attack surface, which
fail with EPERM (clone3 with ENOSYS, so the C library falls back to clone, and clone itself
is refused only when it asks for a new user namespace). The `unshare` backend loads it in
its bootstrap just before the exec; `bwrap` gets it as compiled BPF (`--seccomp FD`); the
`docker` backend has the engine's default profile.

`libseccomp.so.2` is on every Debian system (apt needs it); where it is missing the sandbox
fails closed.
"""

from __future__ import annotations

import ctypes
import errno
import os

DENIED = (
    # other processes' memory, kernel keyrings, eBPF, perf, page-fault handling from user space
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    # namespaces, mounts, the root
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount",
    "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr",
    # io_uring (a second way into most of the kernel), handles, modules, the machine itself
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "iopl", "ioperm", "lookup_dcookie", "fanotify_init", "personality",
)  # fmt: skip
BOX_MAKING = ("unshare", "mount", "umount2", "pivot_root", "chroot")
"""What a local backend (bwrap, unshare) calls to make a box: allowed to the gateway's own
container (`container_profile`), denied to the code inside the box."""
CLONE_NEWUSER = 0x10000000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_MASKED_EQ = 7


def _errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _library() -> ctypes.CDLL:
    try:  # the soname first: find_library runs ldconfig (milliseconds, in every sandbox)
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        from ctypes.util import find_library  # noqa: PLC0415 (slow to import: rarely needed)

        lib = ctypes.CDLL(find_library("seccomp") or "libseccomp.so", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    return lib


def unavailable() -> str | None:
    """Why the filter cannot be built here (None when it can)."""
    try:
        _library()
    except OSError as exc:
        return f"libseccomp (libseccomp2) is not installed: {exc}"
    return None


def _context(lib: ctypes.CDLL) -> int:
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(action: int, name: str, *args: _ArgCmp) -> None:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # not a call on this architecture
            return
        array = (_ArgCmp * len(args))(*args) if args else None
        code = lib.seccomp_rule_add_array(ctx, action, number, len(args), array)
        if code < 0:
            raise OSError(-code, f"seccomp rule for {name}: {os.strerror(-code)}")

    for name in DENIED:
        rule(_errno(errno.EPERM), name)
    rule(_errno(errno.ENOSYS), "clone3")  # its flags cannot be inspected: make libc use clone
    rule(_errno(errno.EPERM), "clone", _ArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    return ctx


def bpf() -> bytes:
    """The filter compiled to BPF (what `bwrap --seccomp FD` reads)."""
    lib = _library()
    ctx = _context(lib)
    fd = os.memfd_create("treadle-seccomp")
    try:
        code = lib.seccomp_export_bpf(ctx, fd)
        if code < 0:
            raise OSError(-code, f"seccomp_export_bpf: {os.strerror(-code)}")
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        lib.seccomp_release(ctx)
        os.close(fd)


def load() -> None:
    """Apply the filter to this process (and what it execs); sets no_new_privs too."""
    lib = _library()
    ctx = _context(lib)
    try:
        code = lib.seccomp_load(ctx)
        if code < 0:
            raise OSError(-code, f"seccomp_load: {os.strerror(-code)}")
    finally:
        lib.seccomp_release(ctx)


def container_profile() -> dict:
    """The gateway container's own seccomp profile, in the Docker/OCI JSON format (compose
    `seccomp=deploy/seccomp/env-gateway.json`, a Kubernetes `Localhost` profile): every call
    of `DENIED` but those that make a box (`BOX_MAKING`, and `clone` of a user namespace)
    fails with EPERM, on the native architecture and its 32-bit ones. Tighter than
    `Unconfined`, which a bwrap gateway needed before; looser than the engine's default, which
    refuses the namespaces and mounts bwrap makes."""
    denied = sorted(set(DENIED) - set(BOX_MAKING))
    arches = {"SCMP_ARCH_X86_64": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]}
    arches["SCMP_ARCH_AARCH64"] = ["SCMP_ARCH_ARM"]
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "archMap": [{"architecture": a, "subArchitectures": s} for a, s in arches.items()],
        "syscalls": [{"names": denied, "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM}],
    }
