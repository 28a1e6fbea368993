"""Server-sent events of the gateway protocols: ``event: <type>`` + ``data: <json>`` (Responses
and Messages name every event), and the stream's end on an error or a client that left."""

from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from megatron_s2.serve.backend import ClientDisconnected, Generation
from megatron_s2.serve.errors import HTTPError

__all__ = ["named_event", "sse_response"]


def named_event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_response(gen: Generation, chunks, error_event) -> StreamingResponse:
    """``chunks`` as an event stream; an engine error mid-stream becomes ``error_event(exc)``."""

    async def events():
        try:
            async for part in chunks:
                yield part
        except ClientDisconnected:
            return
        except HTTPError as exc:
            yield error_event(exc)
        finally:
            gen.abort()

    return StreamingResponse(events(), media_type="text/event-stream")
