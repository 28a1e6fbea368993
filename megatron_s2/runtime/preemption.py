"""Preemption: catch the scheduler's warning signal in every rank and stop all ranks together.

SLURM sends ``--signal=B:USR1@<lead>`` to the batch shell ahead of the time limit (or on
preemption); the generated batch script forwards it to the training step, so every rank
receives it (the local launcher forwards SIGTERM/SIGUSR1 the same way). The signal handler
only sets a flag: a rank may be inside a collective when it arrives, so nothing is saved
from the handler. After each optimiser step the trainer calls :meth:`PreemptionGuard.should_stop`,
an all-reduce (MAX) of the flag over the default process group, so every rank agrees on
the same step, saves a checkpoint and exits with :data:`EXIT_PREEMPTED`. The batch script
then requeues the job, which resumes from that checkpoint.

A checkpoint saved on preemption is announced to the batch script by the ``PREEMPTED`` marker
in the run directory (:mod:`megatron_s2.runtime.markers`), written after the save committed
and before any rank exits: exit codes alone do not survive ``srun --kill-on-bad-exit`` or
torchrun.

Signals can arrive before the trainer has read its recipe (SLURM may deliver the warning
signal, or ``scancel --signal``, seconds after the job starts). ``megatron-s2 train`` therefore
calls :func:`catch_early` first thing, before the slow imports: every signal of
:data:`~megatron_s2.config.launcher.PREEMPTION_SIGNALS` is recorded from then on, and
:meth:`PreemptionGuard.from_config` adopts that guard (a signal received early is a stop
request). SIGINT (Ctrl-C) is a stop request like SIGTERM: the step finishes, a checkpoint is
saved, the rank exits 75; a second Ctrl-C raises KeyboardInterrupt at once.

Usage in a training loop::

    guard = PreemptionGuard.from_config(recipe.launcher).install()
    for step in ...:
        train_step()
        if guard.should_stop():
            save_checkpoint(); sys.exit(EXIT_PREEMPTED)
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Callable, Iterable

from megatron_s2.config.launcher import PREEMPTION_SIGNALS, LauncherConfig

__all__ = ["EXIT_PREEMPTED", "PreemptionGuard", "catch_early", "signal_number"]

EXIT_PREEMPTED = 75
"""Exit code of a rank that stopped on a preemption signal after saving a checkpoint.

75 is ``EX_TEMPFAIL`` from ``sysexits.h`` ("temporary failure, retry later"); it is distinct
from 1 (crash), 2 (configuration error), 124 (``timeout``) and 128+N (killed by signal N).
The launchers treat it as "stopped cleanly, resume me", never as a failure."""

DEFAULT_SIGNALS = ("USR1", "TERM")


def signal_number(name: str) -> signal.Signals:
    """``"USR1"`` or ``"SIGUSR1"`` -> ``signal.SIGUSR1``."""
    key = name.upper()
    key = key if key.startswith("SIG") else f"SIG{key}"
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}") from None


class PreemptionGuard:
    """Turns preemption signals into a flag that all ranks agree on at step boundaries."""

    def __init__(self, signals: Iterable[str] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(dict.fromkeys(signal_number(s) for s in signals))
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Callable | int | None] = {}
        self._interrupts = 0

    @classmethod
    def from_config(cls, config: LauncherConfig) -> "PreemptionGuard":
        """Catch the configured warning signal (``launcher.signal``), SIGTERM and SIGINT. When
        :func:`catch_early` ran, its guard is returned, narrowed to those signals (keeping a
        signal it already received)."""
        wanted = (config.signal, "TERM", "INT")
        if _EARLY is not None:
            return _EARLY.narrow(wanted)
        return cls(wanted)

    def narrow(self, signals: Iterable[str]) -> "PreemptionGuard":
        """Keep catching only ``signals``; the others get their previous handlers back."""
        keep = {signal_number(s) for s in signals}
        for sig in [s for s in self._previous if s not in keep]:
            handler = self._previous.pop(sig)
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.signals = tuple(s for s in self.signals if s in keep) + tuple(
            s for s in dict.fromkeys(signal_number(x) for x in signals) if s not in self.signals)
        if self._previous:  # installed: cover the added signals too
            self.install()
        return self

    # ---- signal handling -----------------------------------------------------------------
    def install(self) -> "PreemptionGuard":
        """Install the handlers (main thread only); returns self for chaining."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard.install() must be called from the main thread")
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        # The local launcher starts ranks with these signals blocked, so that one sent during
        # interpreter start-up waits (pending) for this handler instead of killing the rank.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before :meth:`install` (and forget this
        guard if it was the :func:`catch_early` one)."""
        global _EARLY
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if _EARLY is self:
            _EARLY = None

    def __enter__(self) -> "PreemptionGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts > 1:
                raise KeyboardInterrupt
            print("interrupted: finishing this step, saving a checkpoint, then exiting "
                  "(Ctrl-C again stops at once without saving)", file=sys.stderr, flush=True)
        if self._received is None:
            self._received = signal.Signals(signum)

    # ---- queries -------------------------------------------------------------------------
    @property
    def received(self) -> signal.Signals | None:
        """The first preemption signal this rank received, if any (local, no communication)."""
        return self._received

    def request_stop(self) -> None:
        """Ask for a stop as if a signal had arrived (e.g. from a wall-clock budget)."""
        if self._received is None:
            self._received = signal.SIGTERM

    def should_stop(self) -> bool:
        """True on every rank when any rank received a preemption signal.

        Collective when torch.distributed is initialised: every rank must call it at the
        same point (after each optimiser step). Costs one one-element all-reduce.
        """
        local = self._received is not None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local
        import torch

        device = "cpu"
        if dist.get_backend() == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


_EARLY: PreemptionGuard | None = None


def catch_early(signals: Iterable[str] = PREEMPTION_SIGNALS) -> PreemptionGuard:
    """Record preemption signals from now on (first thing in a rank process, before the slow
    imports); :meth:`PreemptionGuard.from_config` later adopts this guard. Idempotent."""
    global _EARLY
    if _EARLY is None:
        _EARLY = PreemptionGuard(signals).install()
    return _EARLY
