"""The preemption signal (DESIGN.md section 7): the first SIGTERM asks for a checkpoint-and-stop
at the next step boundary; a second one terminates at once, as the default action would. One
rule for the reference trainer (SIGTERM and SIGINT, from the start) and for the helper API
(SIGTERM only, from the first should_stop(): a stop that nobody polls for must not be
swallowed)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType


class StopFlag:
    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.requested = False
        self.installed = False

    def install(self) -> None:
        """Take over the signals. Only the main thread may set handlers: elsewhere, and once
        installed, this does nothing."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        self.installed = True
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = True
