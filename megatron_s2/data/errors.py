"""The error type of the data pipeline.

A :class:`DataError` means the *data* cannot be used as asked: a missing or corrupt file, a
malformed jsonl record, a prompt a task cannot parse, a resume state from another dataset.
Its message names the file or value and says how to fix it; command-line tools print it and
exit non-zero without a traceback.
"""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """Unusable training data; the message names the file or value and the fix."""

    exit_code = 1
