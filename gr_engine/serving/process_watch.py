"""Whether a process that need not be this one's child is still alive (an API server watching its engine core)."""

from __future__ import annotations

import os
import select


class ProcessWatch:
    """Watches process ``pid``: on Linux through a pidfd, which turns readable when the process exits (a zombie
    counts as exited); elsewhere by ``kill(pid, 0)``.

    Raises:
        ProcessLookupError: no process ``pid`` exists.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None

    def alive(self) -> bool:
        """Whether the process has not exited."""
        if self._fd is not None:
            return not select.select([self._fd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        """Release the pidfd."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
