"""A POSIX shared-memory segment mapped in this process: the transport under the CPU fused tail
(service/tail/shm.py) and the TP group's shared-memory collectives (shm_group.py). Here, below
both, so neither package imports the other for it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

SHM_DIR = "/dev/shm"
_PR_SET_TIMERSLACK = 29
_slack_set = threading.local()


class SegmentSizeError(RuntimeError):
    """A peer's segment exists with another size than this process expects."""


def tight_sleep_slack() -> None:
    """Let this thread's short sleeps end near their time (Linux adds 50 us slack by default)."""
    if getattr(_slack_set, "done", False):
        return
    _slack_set.done = True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: sleeps are just a little longer
        pass


class Segment:
    """One rank's region: created (and owned: unlinked by it) or attached by name."""

    def __init__(self, name: str, size: int, create: bool):
        self.name, self.size, self.owner = name, size, create
        path = os.path.join(SHM_DIR, name)
        if create:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                # A crashed run with the same group name left it behind; peers attach only after
                # the barrier that follows this constructor, so recreating it is safe.
                os.unlink(path)
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(path, os.O_RDWR)
            found = os.fstat(fd).st_size
            if found != size:
                os.close(fd)
                raise SegmentSizeError(f"shared-memory segment {name} has {found} bytes, expected {size}")
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.base <= addr and addr + nbytes <= self.base + self.size

    def unlink(self) -> None:
        if self.owner:
            self.owner = False
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._anchor = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
        self.unlink()
