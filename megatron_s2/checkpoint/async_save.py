"""One checkpoint write at a time, in a background thread (``checkpoint.async_save``).

The caller first takes a synchronous snapshot of everything it saves (tensors copied to host
memory, non-tensor state serialised), so training may mutate its state as soon as
:meth:`BackgroundWriter.submit` returns. The job then runs the full save protocol — shards,
checksums, manifest, commit marker, rename, ``latest`` — on the checkpoint's own process
group, so the commit still happens only after every rank's write completed. Guarantees:

* :meth:`submit` first waits for the previous job: saves never overlap or reorder;
* :meth:`wait` (called by every later save, every load and at the end of training) joins the
  job and re-raises its failure in the training thread;
* the thread is not a daemon: an interpreter that exits normally still finishes the write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from megatron_s2.checkpoint.format import CheckpointError

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], object], what: str) -> None:
        self.wait()
        self._what = what
        self._thread = threading.Thread(target=self._run, args=(job,), name="checkpoint-writer", daemon=False)
        self._thread.start()

    def _run(self, job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as exc:  # re-raised in the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(f"asynchronous save of {self._what} failed: {type(error).__name__}: {error}") from error
