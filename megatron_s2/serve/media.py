"""Images of chat requests: OpenAI ``image_url`` content parts -> the engine's image spans.

A part ``{"type": "image_url", "image_url": {"url": ...}}`` takes the URL forms vLLM takes, by the
rules of :func:`megatron_s2.data.images.load_image_url`: ``data:image/...;base64,...`` inline;
``file://`` only under ``--allowed-local-media-path DIR`` (as vLLM's flag); ``http(s)://`` is
refused (the server fetches nothing). A hostile or unusable image (truncated, a decompression
bomb, an extreme aspect ratio such as 100000x1, a MIME type that is not the bytes', an animation,
an unsupported format) is a 400 naming the part and the problem; decoding runs on a worker
thread, so other clients are served meanwhile. A model without a vision tower answers any image
part with a 400.
"""

from __future__ import annotations

from typing import Any

from megatron_s2.serve.errors import BadRequest

__all__ = ["ServedImages"]


class ServedImages:
    """What the chat endpoint needs of the engine and the server's media policy for images."""

    def __init__(self, engine, allowed_local_media_path: str = "", max_images: int = 8):
        self.engine = engine
        self.allowed_local_media_path = allowed_local_media_path or None
        self.max_images = max_images

    @property
    def token_id(self) -> int | None:
        """The image placeholder id; None: the model takes no images."""
        return self.engine.image_token_id

    def refuse_unless_supported(self, param: str) -> None:
        if self.token_id is None:
            raise BadRequest(f"{param}: this model takes no images (it has no vision tower); send text parts only",
                             param=param)

    def refuse_too_many(self, count: int, param: str) -> None:
        """A 400 for more image parts than ``--max-images-per-request``, before any is decoded."""
        if count > self.max_images:
            raise BadRequest(f"{param}: {count} image parts; this server takes at most {self.max_images} per request "
                             "(--max-images-per-request)", param=param)

    def load(self, url: Any, param: str):
        """The decoded RGB image of an ``image_url`` part's URL, or a 400 naming the problem."""
        from megatron_s2.data.images import ImageError, load_image_url

        if not isinstance(url, str) or not url:
            raise BadRequest(f"{param}: must be a data:image/...;base64,... or file:// URL", param=param)
        try:
            return load_image_url(url, allowed_local_media_path=self.allowed_local_media_path)
        except ImageError as exc:
            raise BadRequest(f"{param}: {exc}", param=param) from None

    def prepare(self, prompt: list[int], images: list, param: str) -> tuple[list[int], list]:
        """The prompt with every placeholder expanded to its image's span, and the spans."""
        try:
            return self.engine.prepare_images(prompt, images)
        except ValueError as exc:
            raise BadRequest(f"{param}: {exc}", param=param) from None
