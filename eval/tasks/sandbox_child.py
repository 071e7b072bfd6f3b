"""The sandbox's first code in the child (run as ``python -I -S -c <this file's source> ...``).

Never imported by the parent: it is this file's text that runs, so it uses the standard library only.
Arguments: ``--namespaces|--audit-hook SCRATCH SCRATCH_MB [--no-audit-hook]``; the program is
``SCRATCH/program.py``. (``--no-audit-hook`` lets the tests show what the kernel alone enforces.)

With ``--namespaces`` it is process 1 of fresh user, mount, network and PID namespaces (made by
``unshare``) and, before any untrusted code runs:
1. remounts every mount read-only (locked in step 4, so the program cannot undo it), puts an empty
   read-only tmpfs over /dev (no device node is reachable: the process keeps the real uid, so DAC
   alone would let a root parent's child write /dev/vda or /proc/sysrq-trigger) and a size-capped
   tmpfs over the scratch directory, the one writable place;
2. the network namespace has only a loopback interface, down;
3. installs a seccomp filter: socket(), execve()/execveat() and fork()/vfork()/clone()/clone3() fail
   with EPERM, so no socket of any family (AF_UNIX included), no other program, no new process or
   thread (which also makes RLIMIT_NPROC unnecessary: Linux does not apply it to uid 0);
4. moves into a nested user + mount namespace: mounts copied into a less privileged namespace are
   locked (read-only flags cannot be cleared, mounts cannot be lifted to uncover what is below).
With ``--audit-hook`` only step 3 and the audit hook apply, in the scratch directory on disk.

In both modes a ``sys.addaudithook`` hook then refuses, at the Python level, opening files for writing and
mutating calls outside the scratch directory, sockets, new processes and ctypes. An audit hook is
not a security boundary (PEP 578): it is the only file-system guard in ``--audit-hook`` mode.
"""
import ctypes
import os
import platform
import re
import struct
import sys

EXIT_SETUP_FAILED = 125
EXIT_MEMORY = 124

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 16384, 1 << 18, 1 << 21
ST_TO_MS = {os.ST_RDONLY: MS_RDONLY, os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV,
            os.ST_NOEXEC: MS_NOEXEC, os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME,
            os.ST_RELATIME: MS_RELATIME}
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000

# seccomp: audit arch, then the denied calls (socket, execve, execveat, fork, vfork, clone, clone3)
SYSCALLS = {"x86_64": (0xC000003E, 41, 59, 322, 57, 58, 56, 435), "aarch64": (0xC00000B7, 198, 221, 281, 220, 435)}
X32_SYSCALL_BIT = 0x40000000
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
RET_ALLOW, RET_ERRNO_EPERM, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000 | 1, 0x80000000
LD_ABS_W, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06

libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target, fstype, flags, data=None):
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
          f"mount {target}")


def mount_flags(path):
    """The flags a bind remount of ``path`` must keep (the kernel refuses to drop locked ones)."""
    have = os.statvfs(path).f_flag
    return sum(ms for st, ms in ST_TO_MS.items() if have & st)


def mount_points():
    points = []
    with open("/proc/self/mountinfo") as table:
        for line in table:
            field = line.split()[4]  # octal escapes: "\\040" is a space
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field))
    return points


def isolate_filesystem(scratch, scratch_mb):
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    for point in dict.fromkeys(mount_points()):
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | mount_flags(point))
    mount("tmpfs", "/dev", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NOEXEC, "size=4k,mode=755")
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={scratch_mb}m,mode=700")


def lock_mounts():
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")


def deny_sockets_exec_and_fork():
    machine = platform.machine()
    if machine not in SYSCALLS:
        raise OSError(f"no seccomp syscall table for {machine}")
    arch, *denied = SYSCALLS[machine]
    program = [(LD_ABS_W, 0, 0, 4), (JEQ_K, 1, 0, arch), (RET_K, 0, 0, RET_KILL_PROCESS), (LD_ABS_W, 0, 0, 0)]
    if machine == "x86_64":  # x32 calls carry their own numbers
        program.append((JGE_K, len(denied) + 1, 0, X32_SYSCALL_BIT))
    for i, number in enumerate(denied):
        program.append((JEQ_K, len(denied) - i, 0, number))
    program += [(RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, RET_ERRNO_EPERM)]
    code = b"".join(struct.pack("HBBI", *row) for row in program)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("HxxxxxxP", len(program), ctypes.addressof(buffer))
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")


def install_audit_hook(scratch):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    denied = {"socket.__new__", "socket.connect", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn",
              "os.spawn", "os.fork", "os.forkpty", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
              "ctypes.PyObj_FromPtr"}
    # event -> positions of path arguments that must stay inside the scratch directory
    path_args = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
                 "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,), "os.lchflags": (0,),
                 "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,)}
    realpath, sep, fspath = os.path.realpath, os.sep, os.fspath

    def inside(path):
        if isinstance(path, int):  # an open descriptor: it was checked when it was opened
            return True
        resolved = realpath(fspath(path))
        if isinstance(resolved, bytes):
            resolved = resolved.decode(errors="surrogateescape")
        return resolved == scratch or resolved.startswith(scratch + sep)

    def hook(event, args):
        if event in denied:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[2] & write_flags and not inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the scratch directory")
        for i in path_args.get(event, ()):
            if not inside(args[i]):
                raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the scratch directory")

    sys.addaudithook(hook)


def main():
    mode, scratch, scratch_mb = sys.argv[1], os.path.realpath(sys.argv[2]), int(sys.argv[3])
    try:
        with open(os.path.join(scratch, "program.py")) as f:
            source = f.read()
        if mode == "--namespaces":
            isolate_filesystem(scratch, scratch_mb)
            lock_mounts()
        os.chdir(scratch)
        deny_sockets_exec_and_fork()
    except OSError as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        sys.exit(EXIT_SETUP_FAILED)
    if "--no-audit-hook" not in sys.argv[4:]:
        install_audit_hook(scratch)
    sys.argv = ["program.py"]
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
    except MemoryError:
        print("MemoryError: the sandbox's memory limit was reached", file=sys.stderr)
        sys.exit(EXIT_MEMORY)


if __name__ == "__main__":  # as ``python -c``; importing it does nothing
    main()
