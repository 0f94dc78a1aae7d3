"""Every run ends well: SIGINT or SIGTERM (Kubernetes sends it before evicting a pod) asks the
loop to stop after the step in flight; the trainer then writes a checkpoint and raises
`Interrupted`, which the CLI turns into one line and exit code 128 + signal (130, 143).
A second signal exits at once."""
from __future__ import annotations

import signal
import threading

from deeprec.errors import DeepRecError

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(DeepRecError):
    """The run stopped on a signal after finishing step `step`; `checkpoint`: where it was saved."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        saved = (f"checkpoint {checkpoint} (continue with --resume)" if checkpoint
                 else "no checkpoint (no --checkpoint-dir)")
        super().__init__(f"stopped by {name} after step {step}: {saved}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopOnSignals:
    """Inside `with`, SIGINT/SIGTERM set `requested` (the first) or exit at once (the second).
    Only the main thread can take signals: elsewhere this does nothing."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        for sig in SIGNALS:  # the second signal kills at the C level: even a step blocked in a
            signal.signal(sig, signal.SIG_DFL)  # collective or an RPC, where Python handlers never run

    def __enter__(self) -> "StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            handler = self._handle if self.signal is None else signal.SIG_DFL  # asked once: the next one kills
            self._previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


__all__ = ["Interrupted", "StopOnSignals"]
