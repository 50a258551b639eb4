"""One writer per run directory: an OS lock on `run_dir/.purestep.lock`.

The lock is `fcntl.flock` on a file descriptor this process keeps open, so a run that
dies in any way (killed, crashed, out of memory) releases it with its last descriptor:
a run directory is never left locked. The file holds one line naming the holder
(pid, host, since when), read back for the message a second writer gets.

Within one process the lock is shared: every `RunLock` of a directory counts on one
descriptor, so a script that opens two managers on one run does not lock itself out.

File systems without working locks (some NFS mounts, FUSE, Lustre without `flock`)
raise `ENOLCK`, `EOPNOTSUPP` or `ENOSYS`: the run goes on unlocked with one warning,
since refusing to train there would be worse; the holder line is still written.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import sys
import threading
from pathlib import Path

from ..errors import RunDirError

LOCK_FILE = ".purestep.lock"
_HELD_ELSEWHERE = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)

_held: dict[str, list[int]] = {}  # realpath of the lock file -> [descriptor, users]
_guard = threading.Lock()


def holder_line() -> str:
    since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"pid {os.getpid()} on {socket.gethostname()} since {since}"


def _holder(path: Path) -> str:
    try:
        line = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        line = []
    return line[0] if line else "holder unknown"


class RunLock:
    """This process's hold on a run directory; `acquire` raises `RunDirError` when another process holds it."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.held = False
        self.enforced = True  # False on a file system without working locks

    def acquire(self) -> "RunLock":
        """Hold the directory (created if missing); a no-op when this object holds it already."""
        if self.held:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        with _guard:
            if key in _held:
                _held[key][1] += 1
                self.held = True
                return self
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in _HELD_ELSEWHERE:
                    os.close(fd)
                    raise RunDirError(
                        f"{self.run_dir}: in use by another run ({_holder(self.path)}); wait for it to end "
                        "or stop it, or pass another --out"
                    ) from None
                self.enforced = False
                print(
                    f"purestep: warning: {self.run_dir}: the file system does not lock files ({e.strerror}); "
                    "a second run writing here at the same time is not refused",
                    file=sys.stderr,
                    flush=True,
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, (holder_line() + "\n").encode(), 0)
            _held[key] = [fd, 1]
        self.held = True
        return self

    def release(self) -> None:
        """Let go of the directory; the lock is freed when the last holder in this process lets go."""
        if not self.held:
            return
        self.held = False
        key = os.path.realpath(self.path)
        with _guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                os.close(entry[0])  # closing the last descriptor releases the flock

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: the OS releases it with the process
            pass
