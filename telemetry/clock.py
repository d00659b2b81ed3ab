"""The clocks the engine telemetry stamps its data with, passed in
(``EngineTelemetry(..., clock=...)``): the system's by default; the what-if
twin passes its virtual one, so that its event log and snapshots are in
virtual time."""

from __future__ import annotations

import time


class Clock:
    """The system's clocks (read at each call); a subclass reads others."""

    def monotonic_ns(self) -> int:
        """ns on the engine core's monotonic clock (the scheduler's steps
        are stamped on it)."""
        return time.monotonic_ns()

    def time_ns(self) -> int:
        """ns since the Unix epoch."""
        return time.time_ns()

    def time(self) -> float:
        return self.time_ns() / 1e9


#: the system's clocks
SYSTEM = Clock()
