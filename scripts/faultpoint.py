"""Run an nrvna command with every workspace-changing call counted, and optionally fail one.

Used by the crash-point and fault tests (test_nrvna.py, #10); not part of nrvna. It wraps the
`os` functions nrvna's file primitives call (and the renameat2 ctypes function), counts the
calls that change files under WORKSPACE, in order, across threads, and at call K either kills
the whole process with SIGKILL at the call's entry (as `strace -e inject=CALL:signal=KILL`
does) or makes that call fail with an errno (as `inject=CALL:error=E`).

    python scripts/faultpoint.py WORKSPACE LOG MODE -- daemon|submit ARGS...
    (daemon with MODEL "-" runs the tests' prompt-derived runner; a real path runs llama.cpp)
    MODE: list | kill:K | errno:K:ERRNO   (ERRNO such as EIO, ENOSPC, EXDEV)

LOG receives one line per counted call ("name path"), written as they happen. The daemon's
Watcher thread is not counted (see hit()).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import nrvna  # noqa: E402

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC


def main() -> int:
    workspace, log_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    command = sys.argv[sys.argv.index("--") + 1:]
    root = os.path.realpath(workspace)
    log = open(log_path, "a", buffering=1)
    lock = threading.Lock()
    count = [0]
    kind, target, code = (mode.split(":") + ["", ""])[:3]
    target = int(target) if target else 0

    def resolve(path: object, dir_fd: object = None) -> str:
        if isinstance(path, int):
            return os.readlink(f"/proc/self/fd/{path}")
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.abspath(path)

    def hit(name: str, path: str) -> None:
        if not (path == root or path.startswith(root + os.sep)):
            return
        if threading.current_thread().name == "Watcher" or "daemon.json" in os.path.basename(path):
            # daemon.json and a running job's partial.txt are for watching, not state: their
            # writes come at timer ticks, so counting them would make crash points drift.
            return
        with lock:
            count[0] += 1
            n = count[0]
            log.write(f"{name} {os.path.relpath(path, root)}\n")
        if n == target and kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if n == target and kind == "errno":
            number = getattr(errno, code)
            raise OSError(number, os.strerror(number), path)

    def wrap(name: str, real, path_of) -> None:
        def wrapper(*args, **kwargs):
            path = path_of(*args, **kwargs)
            if path is not None:
                hit(name, path)
            return real(*args, **kwargs)
        setattr(os, name, wrapper)

    wrap("mkdir", os.mkdir, lambda p, *a, dir_fd=None, **k: resolve(p, dir_fd))
    wrap("open", os.open, lambda p, flags, *a, dir_fd=None, **k:
         resolve(p, dir_fd) if flags & WRITE_FLAGS else None)
    wrap("write", os.write, lambda fd, *a: resolve(fd))
    wrap("pwrite", os.pwrite, lambda fd, *a: resolve(fd))
    wrap("ftruncate", os.ftruncate, lambda fd, *a: resolve(fd))
    wrap("fsync", os.fsync, lambda fd: resolve(fd))
    wrap("rename", os.rename, lambda s, d, *, src_dir_fd=None, **k: resolve(s, src_dir_fd))
    wrap("unlink", os.unlink, lambda p, *, dir_fd=None: resolve(p, dir_fd))
    wrap("rmdir", os.rmdir, lambda p, *, dir_fd=None: resolve(p, dir_fd))
    real_renameat2 = nrvna._load_renameat2()
    if real_renameat2:
        def renameat2(olddir, old, newdir, new, flags):
            hit("renameat2", resolve(old))
            return real_renameat2(olddir, old, newdir, new, flags)
        nrvna._renameat2 = renameat2
    runner = None
    if command[0] == "daemon" and command[1] == "-":  # no model: the tests' derived runner
        import test_nrvna

        runner = test_nrvna.RUNNERS["derived"]
    return nrvna.main(command, runner=runner)


if __name__ == "__main__":
    raise SystemExit(main())
