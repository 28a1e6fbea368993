"""Safe image decoding: bytes, local files and image URLs -> one RGB Pillow image (issue 22).

Images reach the vision pathway (report 003 §2.1.1) from local datasets, ``generate --image``
and the server's OpenAI content parts ``{"type": "image_url", "image_url": {"url": ...}}``.
Every one passes :func:`decode_image`, which refuses a hostile or unusable file with one
:class:`ImageError` line naming the source and the problem (the server answers it with a 400):

* **format** — sniffed from the leading bytes, never from a name or a MIME type; only PNG, JPEG,
  WebP, GIF and BMP are opened, and Pillow is told so (``Image.open(formats=...)``), so no other
  plugin (EPS hands files to Ghostscript, for one) ever sees untrusted bytes;
* **decompression bombs** — the header's ``width x height`` against :attr:`ImageLimits.max_pixels`
  before any pixel is decoded; Pillow's own ``DecompressionBombWarning`` / ``Error`` count too;
* **extreme aspect ratios** — beyond :attr:`ImageLimits.max_aspect_ratio` (200, as Qwen2-VL's
  processor; a 100000x1 strip has nothing to see and breaks resize planning);
* **animations** — refused, not reduced to their first frame: like the OpenAI API
  ("non-animated GIF"), we would rather say so than silently answer about one frame;
* **truncated or corrupt data** — the decoder's failure, caught and named;
* **size** — files and data URLs over :attr:`ImageLimits.max_bytes` are refused unread.

What decodes is made RGB deterministically: EXIF orientation applied; alpha (RGBA, LA, PA,
palette or grey with a transparent colour) composited over opaque white (as vLLM); 16-bit grey
scaled to 8 bits by ``round(v * 255 / 65535)`` (Pillow's own ``convert`` would clip at 255);
CMYK, palette, grey and bilevel through Pillow's conversion.

URLs (:func:`load_image_url`) follow vLLM's rules: ``data:image/...;base64,...`` is decoded with
the same limits and its MIME type must match the bytes; ``http(s)://`` is refused (no network);
``file://`` is read only under an explicitly allowed directory (``--allowed-local-media-path``),
after resolving symlinks, so a link inside pointing out is refused like ``..``.

Pillow is an optional dependency (``pip install megatron_s2[vision]``), imported on first use.
Resize planning is not done here: it belongs to the model family
(``megatron_s2.models.v41.vision.processor``), which takes the decoded image.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError

__all__ = ["ImageError", "ImageLimits", "ALLOWED_FORMATS", "BACKGROUND", "decode_image", "load_image",
           "decode_data_url", "load_image_url", "to_rgb", "sniff_format", "require_pillow"]

ALLOWED_FORMATS: dict[str, tuple[str, ...]] = {
    "PNG": ("image/png",), "JPEG": ("image/jpeg", "image/jpg"), "WEBP": ("image/webp",),
    "GIF": ("image/gif",), "BMP": ("image/bmp", "image/x-ms-bmp"),
}
"""Formats opened (Pillow's names) and the data-URL MIME types that announce each."""

BACKGROUND = (255, 255, 255)
"""Opaque colour that transparent pixels are composited over."""

# Leading bytes of the accepted formats, and of common refused ones (to name them in the error).
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"%PDF", "PDF"), (b"%!PS", "PostScript"),
    (b"8BPS", "PSD"), (b"\x00\x00\x01\x00", "ICO"), (b"<svg", "SVG"), (b"<?xml", "XML/SVG"),
)
_MIME_FORMAT = {mime: fmt for fmt, mimes in ALLOWED_FORMATS.items() for mime in mimes}
_ACCEPTED = "PNG, JPEG, WebP, GIF or BMP"
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})


class ImageError(DataError):
    """An image that cannot be used; the one-line message names the source and the problem."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may cost before it is refused."""

    max_bytes: int = 20 * 1024 * 1024
    """Largest encoded file / decoded data-URL payload, in bytes (the OpenAI API's 20 MB)."""
    max_pixels: int = 32 * 1024 * 1024
    """Largest ``width * height`` decoded (about 5800 x 5800); Pillow's own cap, ~89 M, also holds."""
    max_aspect_ratio: float = 200.0
    """Largest ``long side / short side``."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)}")
        if not self.max_aspect_ratio >= 1:
            raise ConfigError(f"max_aspect_ratio: must be >= 1, got {self.max_aspect_ratio}")


def require_pillow() -> tuple[Any, Any]:
    """Pillow's ``Image`` and ``ImageOps`` modules, or a one-line error saying how to get them."""
    try:
        from PIL import Image, ImageOps
    except ImportError:
        raise ImageError("decoding images needs Pillow: pip install pillow (or megatron_s2[vision])") from None
    return Image, ImageOps


def sniff_format(data: bytes) -> str | None:
    """Format named by the leading bytes (an :data:`ALLOWED_FORMATS` key or a refused one), else None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp":  # ISO media: HEIC / AVIF
        return "HEIF/AVIF"
    return next((fmt for magic, fmt in _MAGIC if data.startswith(magic)), None)


def decode_image(data: bytes, *, limits: ImageLimits = ImageLimits(), source: str = "image",
                 expect_format: str | None = None) -> Any:
    """Encoded bytes -> a decoded RGB Pillow image, or :class:`ImageError` (module docstring).

    ``source`` names the image in errors (a path, "data URL"); ``expect_format`` is the format a
    MIME type announced, refused when the bytes are another."""
    if not data:
        raise ImageError(f"{source}: empty image (0 bytes)")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{source}: {len(data)} bytes exceeds the image size limit of {limits.max_bytes} bytes")
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageError(f"{source}: not a recognised image (leading bytes {data[:8]!r}); send {_ACCEPTED}")
    if fmt not in ALLOWED_FORMATS:
        raise ImageError(f"{source}: unsupported image format {fmt}; send {_ACCEPTED}")
    if expect_format is not None and fmt != expect_format:
        raise ImageError(f"{source}: declared as {expect_format} but the bytes are a {fmt} image")
    Image, ImageOps = require_pillow()
    with warnings.catch_warnings():
        # Pillow warns past its cap (~89 M pixels) and raises past twice it: both are bombs here.
        # catch_warnings is process-wide, not per thread; _check_geometry's own cap is the guard.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=[fmt])
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(f"{source}: decompression bomb refused ({exc})") from None
        except Image.UnidentifiedImageError:  # its text names a BytesIO object's address: say it plainly
            raise ImageError(f"{source}: truncated or corrupt {fmt} image (Pillow cannot identify it)") from None
        except Exception as exc:  # noqa: BLE001 - any decoder failure on hostile bytes is one line
            raise ImageError(f"{source}: truncated or corrupt {fmt} image ({type(exc).__name__}: {exc})") from None
        _check_geometry(image, limits, source)
        try:
            frames = image.n_frames if getattr(image, "is_animated", False) else 1  # headers only
            if frames == 1:
                image.load()
                image = ImageOps.exif_transpose(image)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(f"{source}: decompression bomb refused ({exc})") from None
        except Exception as exc:  # noqa: BLE001
            raise ImageError(f"{source}: truncated or corrupt {fmt} image ({type(exc).__name__}: {exc})") from None
    if frames > 1:
        raise ImageError(f"{source}: animated {fmt} ({frames} frames) is not supported; send a still image")
    return to_rgb(image)


def _check_geometry(image: Any, limits: ImageLimits, source: str) -> None:
    """Refuse from the header alone: no pixels, too many pixels, too elongated."""
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{source}: image of {width}x{height} pixels has no pixels")
    if width * height > limits.max_pixels:
        raise ImageError(f"{source}: decompression bomb refused: {width}x{height} = {width * height} pixels exceeds "
                         f"the cap of {limits.max_pixels}")
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageError(f"{source}: extreme aspect ratio {width}x{height} ({ratio:.0f}:1) exceeds the limit of "
                         f"{limits.max_aspect_ratio:g}:1")


def to_rgb(image: Any) -> Any:
    """Any decoded Pillow image -> RGB, deterministically (module docstring)."""
    Image, _ = require_pillow()
    mode = image.mode
    if mode.startswith("I;16") or mode == "I":
        import numpy as np

        wide = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8), "L").convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if mode == "RGB" else image.convert("RGB")


def _read_capped(path: Path, limits: ImageLimits, source: str) -> bytes:
    """A file's bytes, refused unread when over ``limits.max_bytes``."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except FileNotFoundError:
        raise ImageError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise ImageError(f"{source}: is a directory, not an image file") from None
    except OSError as exc:
        raise ImageError(f"{source}: cannot read ({exc.strerror or exc})") from None
    if len(data) > limits.max_bytes:
        raise ImageError(f"{source}: file exceeds the image size limit of {limits.max_bytes} bytes")
    return data


def load_image(path: str | Path, *, limits: ImageLimits = ImageLimits()) -> Any:
    """A local image file (a dataset's, ``generate --image``) -> a decoded RGB Pillow image."""
    return decode_image(_read_capped(Path(path), limits, str(path)), limits=limits, source=str(path))


def decode_data_url(url: str, *, limits: ImageLimits = ImageLimits()) -> Any:
    """``data:image/<type>;base64,<payload>`` -> a decoded RGB Pillow image; the MIME must match the bytes."""
    if not url.startswith("data:"):
        raise ImageError(f"not a data URL (it must start with 'data:'): {url[:40]!r}")
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise ImageError("malformed data URL: no ',' between the header and the payload")
    mime, *params = [part.strip().lower() for part in header.split(";")]
    if mime not in _MIME_FORMAT:
        raise ImageError(f"data URL has MIME type {mime or 'text/plain'!r}; expected one of "
                         f"{', '.join(sorted(_MIME_FORMAT))}")
    if "base64" not in params:
        raise ImageError("data URL is not base64-encoded: use data:<mime>;base64,<payload>")
    if len(payload) > 4 * math.ceil(limits.max_bytes / 3):  # refuse before allocating the decode
        raise ImageError(f"data URL payload of {len(payload)} base64 characters exceeds the image size limit of "
                         f"{limits.max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"data URL has invalid base64 ({exc})") from None
    return decode_image(data, limits=limits, source="data URL", expect_format=_MIME_FORMAT[mime])


def load_image_url(url: str, *, allowed_local_media_path: str | Path | None = None,
                   limits: ImageLimits = ImageLimits()) -> Any:
    """An image URL of a request -> a decoded RGB Pillow image (vLLM's rules, module docstring)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, limits=limits)
    if scheme in ("http", "https"):
        raise ImageError(f"remote image URLs are not fetched (no network): {url[:60]!r}; send the image inline as "
                         "data:image/png;base64,...")
    if scheme != "file":
        raise ImageError(f"unsupported image URL scheme {scheme or '(none)'!r}; use data:image/...;base64,... "
                         "or file:// under --allowed-local-media-path")
    return load_image(_allowed_local_path(url, allowed_local_media_path), limits=limits)


def _allowed_local_path(url: str, allowed_local_media_path: str | Path | None) -> Path:
    """The resolved path of a ``file://`` URL, refused unless it lies under the allowed directory."""
    if allowed_local_media_path is None:
        raise ImageError("file:// image URLs are refused unless the server is started with "
                         "--allowed-local-media-path DIR")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageError(f"file URL names a remote host {parts.netloc!r}; only local files are read")
    path = Path(unquote(parts.path))
    if not path.is_absolute():
        raise ImageError(f"file URL must carry an absolute path, got {parts.path!r}")
    root = Path(allowed_local_media_path)
    if not root.is_dir():
        raise ConfigError(f"allowed_local_media_path: {root} is not a directory; pass an existing one")
    resolved = path.resolve()  # follows symlinks, so a link inside that points out lands outside
    if not resolved.is_relative_to(root.resolve()):
        raise ImageError(f"file URL {path} resolves outside the allowed local media path {root}")
    return resolved
