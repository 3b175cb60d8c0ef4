"""An exclusive lock on an output directory, so two writers (`hybridmoe convert`, `--resume` included)
never interleave their files.

The lock is an flock on `DIR/.lock` (released by the kernel when its holder dies, so a lock left by
a killed process is simply taken over); the file holds the holder's pid and host, for the message
a second writer gets. The file is removed on release; a writer that opened it just before the
removal notices (its inode is no longer the path's) and tries again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path

from hybridmoe.weights.loader import CheckpointError

log = logging.getLogger(__name__)
LOCK_NAME = ".lock"


class LockedError(CheckpointError):
    """The directory is locked by another live writer."""


class DirLock:
    """`with DirLock(dir, what):` holds the directory's lock; raises LockedError if another process does."""

    def __init__(self, directory: str | Path, what: str = "hybridmoe convert") -> None:
        self.path = Path(directory) / LOCK_NAME
        self.what = what
        self.fd = -1

    def acquire(self) -> None:
        for _ in range(100):  # retried only when the file was replaced under us
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:  # e.g. a directory of that name, or a read-only output directory
                raise CheckpointError(f"{self.path}: cannot be locked: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").split()
                os.close(fd)
                pid = holder[0] if holder else "?"
                host = f" on {holder[1]}" if len(holder) > 1 else ""
                raise LockedError(f"{self.path}: held by {' '.join(holder[2:]) or 'another writer'} (pid {pid}{host}); "
                                  "wait for it to finish or stop it; two writers into one directory would mix "
                                  "their files") from None
            except OSError as e:
                os.close(fd)
                raise CheckpointError(f"{self.path}: cannot be locked: {e}") from e
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and removed by its holder meanwhile: lock the new file instead
                os.close(fd)
                continue
            old = os.pread(fd, 200, 0).decode(errors="replace").split()
            if old:  # the kernel released the lock of a process that did not remove the file: it died
                log.warning("%s: taking over the lock left by pid %s (no longer running)", self.path, old[0])
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {self.what}\n".encode(), 0)
            self.fd = fd
            return
        raise CheckpointError(f"{self.path}: cannot be locked (the file keeps being replaced)")

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still locked: nobody locks the removed inode afterwards
        finally:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
