"""Image decoding (``megatron_s2/data/images.py``) and the procedural image source (issue 22).

Every hostile file is built here with Pillow and must be refused with one line naming the
problem; benign oddities (CMYK, 16-bit, alpha, palette, EXIF rotation) become RGB
deterministically; URLs follow vLLM's data: / file:// / no-network rules. The procedural
source is deterministic and its captions are checked against the pixels."""

from __future__ import annotations

import base64
import io
import struct
import sys
import zlib

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from megatron_s2.config.schema import ConfigError
from megatron_s2.data.errors import DataError
from megatron_s2.data.images import (ImageError, ImageLimits, decode_data_url, decode_image, load_image,
                                     load_image_url)
from megatron_s2.data.procedural_images import COLOURS, procedural_item, procedural_items


def encode(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return buffer.getvalue()


def refused(call, *args, **kwargs) -> str:
    """The message of the ImageError ``call`` raises; it must be a single line."""
    with pytest.raises(ImageError) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert isinstance(caught.value, DataError) and "\n" not in message, message
    return message


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width x height`` grey pixels (a decompression bomb's header)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + idat + chunk(b"IEND", b"")


def noise(size=(64, 64), mode="RGB", seed=0) -> Image.Image:
    channels = len(mode)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def pixels(image: Image.Image) -> list[tuple[int, ...]]:
    return [tuple(p) for p in np.asarray(image).reshape(-1, len(image.mode)).tolist()]


def animated(fmt: str) -> bytes:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "blue")]
    return encode(frames[0], fmt, save_all=True, append_images=frames[1:])


HOSTILE = {
    "truncated": (lambda: encode(noise())[:600], ImageLimits(), "truncated or corrupt PNG"),
    "truncated JPEG": (lambda: encode(noise(), "JPEG")[:2000], ImageLimits(),
                       "truncated or corrupt JPEG image (OSError"),
    "corrupt header": (lambda: b"\x89PNG\r\n\x1a\n" + b"\0" * 40, ImageLimits(),
                       "truncated or corrupt PNG image (Pillow cannot identify it)"),
    "over our pixel cap": (lambda: encode(Image.new("L", (2000, 1000))), ImageLimits(max_pixels=1_000_000),
                           "decompression bomb refused: 2000x1000 = 2000000 pixels exceeds the cap of 1000000"),
    "Pillow's bomb error": (lambda: png_claiming(100_000, 100_000), ImageLimits(),
                            "decompression bomb refused (Image size (10000000000 pixels) exceeds limit"),
    "Pillow's bomb warning": (lambda: png_claiming(10_000, 10_000), ImageLimits(max_pixels=150_000_000),
                              "decompression bomb refused (Image size (100000000 pixels) exceeds limit"),
    "100000x1": (lambda: encode(Image.new("L", (100_000, 1))), ImageLimits(),
                 "extreme aspect ratio 100000x1 (100000:1) exceeds the limit of 200:1"),
    "animated GIF": (lambda: animated("GIF"), ImageLimits(), "animated GIF (2 frames) is not supported"),
    "animated PNG": (lambda: animated("PNG"), ImageLimits(), "animated PNG (2 frames) is not supported"),
    "TIFF": (lambda: encode(noise(), "TIFF"), ImageLimits(), "unsupported image format TIFF"),
    "not an image": (lambda: b"hello, world", ImageLimits(), "not a recognised image"),
    "empty": (lambda: b"", ImageLimits(), "empty image"),
    "over the byte cap": (lambda: encode(noise()), ImageLimits(max_bytes=1000), "exceeds the image size limit"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_image_is_refused_in_one_line(case, tmp_path):
    make, limits, words = HOSTILE[case]
    path = tmp_path / "hostile.img"
    path.write_bytes(make())
    message = refused(load_image, path, limits=limits)
    assert message.startswith(f"{path}: ") and words in message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_each_accepted_format_decodes(fmt):
    lossless = {"lossless": True} if fmt == "WEBP" else {}
    image = decode_image(encode(Image.new("RGB", (6, 4), (0, 0, 255)), fmt, **lossless))
    assert image.mode == "RGB" and image.size == (6, 4)
    assert np.abs(np.asarray(image).astype(int) - (0, 0, 255)).max() <= 4


def test_pillow_missing_is_one_line_at_use(monkeypatch):
    raw = encode(noise())
    monkeypatch.setitem(sys.modules, "PIL", None)  # what `import PIL` sees when it is not installed
    assert "pip install pillow" in refused(decode_image, raw)


def test_image_limits_are_validated():
    with pytest.raises(ConfigError, match="max_aspect_ratio: must be >= 1"):
        ImageLimits(max_aspect_ratio=0.5)
    with pytest.raises(ConfigError, match="max_pixels: must be a positive integer"):
        ImageLimits(max_pixels=0)


def test_cmyk_jpeg_becomes_rgb():
    decoded = decode_image(encode(Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", quality=95))
    assert decoded.mode == "RGB"
    assert np.abs(np.asarray(decoded).astype(int) - (255, 0, 0)).max() <= 8


def test_16_bit_grey_is_scaled_not_clipped():
    wide = Image.fromarray(np.array([[0, 257, 32768, 65535]], dtype=np.uint16))
    raw = encode(wide)
    assert Image.open(io.BytesIO(raw)).mode == "I;16"
    decoded = decode_image(raw)
    assert np.asarray(decoded)[0, :, 0].tolist() == [0, 1, 128, 255] and decoded.mode == "RGB"


def test_alpha_is_composited_over_white():
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(255, 0, 0, 0), (0, 0, 255, 255), (0, 0, 0, 128)])
    assert pixels(decode_image(encode(rgba))) == [(255, 255, 255), (0, 0, 255), (127, 127, 127)]
    grey_alpha = Image.new("LA", (1, 1), (0, 0))
    assert decode_image(encode(grey_alpha)).getpixel((0, 0)) == (255, 255, 255)


def test_palette_with_a_transparent_index():
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 0, 200, 0] + [0] * 762)
    palette.putdata([0, 1])
    assert pixels(decode_image(encode(palette, transparency=0))) == [(255, 255, 255), (0, 200, 0)]
    assert pixels(decode_image(encode(palette))) == [(0, 0, 0), (0, 200, 0)]


def test_exif_orientation_is_applied():
    wide = Image.new("RGB", (4, 2), "blue")
    wide.paste((255, 0, 0), (0, 0, 2, 2))  # left half red
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    upright = decode_image(encode(wide, exif=exif))
    assert upright.size == (2, 4)
    assert upright.getpixel((0, 0)) == (255, 0, 0) and upright.getpixel((0, 3)) == (0, 0, 255)


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def test_a_data_url_decodes():
    image = decode_data_url(data_url(encode(Image.new("RGB", (5, 3), (1, 2, 3)))))
    assert image.size == (5, 3) and image.getpixel((4, 2)) == (1, 2, 3)
    assert decode_data_url(data_url(encode(noise(), "JPEG"), "image/jpeg")).size == (64, 64)


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@@", "invalid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "invalid base64"),  # padding missing
    ("data:text/plain;base64,aGVsbG8=", "MIME type 'text/plain'"),
    ("data:;base64,aGVsbG8=", "MIME type 'text/plain'"),
    ("data:image/svg+xml;base64,PHN2Zz4=", "MIME type 'image/svg+xml'"),
    ("data:image/png,rawbytes", "not base64-encoded"),
    ("data:image/png;base64", "no ','"),
])
def test_a_bad_data_url_is_refused(url, words):
    assert words in refused(decode_data_url, url)


def test_a_data_url_must_say_what_it_carries():
    message = refused(decode_data_url, data_url(encode(noise()), "image/jpeg"))
    assert message == "data URL: declared as JPEG but the bytes are a PNG image"


def test_an_oversize_data_url_is_refused_before_decoding():
    url = data_url(encode(noise()))
    assert "base64 characters exceeds the image size limit of 1000 bytes" in refused(
        decode_data_url, url, limits=ImageLimits(max_bytes=1000))


@pytest.fixture
def media(tmp_path):
    """An allowed directory with an image, a link to it, and a link to an image outside."""
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir(), outside.mkdir()
    Image.new("RGB", (4, 4), "green").save(allowed / "ok.png")
    Image.new("RGB", (4, 4), "red").save(outside / "secret.png")
    (allowed / "inside_link.png").symlink_to(allowed / "ok.png")
    (allowed / "escape.png").symlink_to(outside / "secret.png")
    return allowed


def test_file_urls_under_the_allowed_directory_are_read(media):
    for name in ("ok.png", "inside_link.png"):
        image = load_image_url(f"file://{media / name}", allowed_local_media_path=media)
        assert image.getpixel((0, 0)) == (0, 128, 0)
    assert load_image_url(f"file://localhost{media / 'ok.png'}", allowed_local_media_path=media).size == (4, 4)


@pytest.mark.parametrize("name, words", [
    ("escape.png", "resolves outside the allowed local media path"),
    ("../secret/secret.png", "resolves outside the allowed local media path"),
    ("missing.png", "no such file"),
    (".", "is a directory"),
])
def test_file_urls_that_escape_or_miss_are_refused(media, name, words):
    assert words in refused(load_image_url, f"file://{media}/{name}", allowed_local_media_path=media)


def test_image_url_schemes(media):
    assert "no network" in refused(load_image_url, "https://example.com/cat.png")
    assert "no network" in refused(load_image_url, "http://127.0.0.1/cat.png")
    assert "--allowed-local-media-path" in refused(load_image_url, f"file://{media / 'ok.png'}")
    remote = refused(load_image_url, "file://server/share/a.png", allowed_local_media_path=media)
    assert "remote host 'server'" in remote
    assert "unsupported image URL scheme 'ftp'" in refused(load_image_url, "ftp://host/a.png")
    with pytest.raises(ConfigError, match="allowed_local_media_path: .* is not a directory"):
        load_image_url(f"file://{media / 'ok.png'}", allowed_local_media_path=media / "nope")


# --- the procedural source ---------------------------------------------------------------------

def test_the_procedural_source_is_deterministic():
    first, again = procedural_items(12, seed=3), procedural_items(12, seed=3)
    def content(items):
        return [(item.caption, item.qa, item.image.tobytes()) for item in items]

    assert content(first) == content(again)
    assert procedural_items(4, seed=3, start=8)[0].image.tobytes() == first[8].image.tobytes()  # index-addressed
    other = procedural_items(12, seed=4)
    assert [a.image.tobytes() for a in first] != [b.image.tobytes() for b in other]
    array = procedural_item(0, seed=3, size=48, as_array=True).image
    assert array.dtype == np.uint8 and array.shape == (48, 48, 3)
    assert {item.kind for item in procedural_items(60, seed=0)} == {"shape", "digit", "text"}


def ink(item) -> np.ndarray:
    """Fraction of the way from the background (a corner pixel) to the object colour, per pixel."""
    pixels = np.asarray(item.image, dtype=np.float64)
    background, colour = pixels[0, 0], np.array(COLOURS[item.colour], dtype=np.float64)
    return np.clip((pixels - background) @ (colour - background) / np.sum((colour - background) ** 2), 0, 1)


def classify_shape(mask: np.ndarray) -> str:
    """Name a filled shape from its mask cropped to its bounding box."""
    fill, top, bottom = mask.mean(), mask[0].mean(), mask[-1].mean()
    if fill > 0.95:
        return "square"
    if bottom > 0.9:
        return "triangle"
    if 0.7 < fill < 0.9:
        return "circle"
    return "cross" if top > 0.25 else "diamond"


def test_shape_captions_match_the_pixels():
    for item in procedural_items(60, seed=11, kinds=("shape",)):
        x0, y0, x1, y1 = item.box
        exact = np.all(np.asarray(item.image) == COLOURS[item.colour], axis=-1)  # shapes are drawn unblended
        ys, xs = np.nonzero(exact)
        assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == item.box
        assert exact[(y0 + y1) // 2, (x0 + x1) // 2]  # the centre carries the named colour
        shape = classify_shape(exact[y0:y1, x0:x1])
        article = "an" if item.colour[0] in "aeiou" else "a"
        assert item.caption == f"{article} {item.colour} {shape}" and item.label == shape
        assert item.qa == (("what shape is this?", shape), ("what colour is the shape?", item.colour))


def glyph(mask: np.ndarray) -> np.ndarray:
    """The inked part of a mask, cropped and resized to 12 x 16 for template matching."""
    ys, xs = np.nonzero(mask > 0.5)
    crop = Image.fromarray((mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1] * 255).astype(np.uint8))
    return np.asarray(crop.resize((12, 16), Image.BILINEAR), dtype=np.float64) / 255


def test_digits_are_recovered_by_template_matching():
    templates = {}
    for digit in "0123456789":
        canvas = Image.new("L", (64, 64), 0)
        ImageDraw.Draw(canvas).text((8, 0), digit, font=ImageFont.load_default(size=48), fill=255)
        templates[digit] = glyph(np.asarray(canvas, dtype=np.float64) / 255)
    items = procedural_items(40, seed=5, kinds=("digit",))
    assert len({item.label for item in items}) == 10
    for item in items:
        seen = glyph(ink(item))
        guess = min(templates, key=lambda d: np.sum((templates[d] - seen) ** 2))
        assert guess == item.label and item.caption == f"the digit {item.label}"
        assert item.qa[0] == ("what digit is this?", item.label)


def test_text_stroke_draws_the_same_digits_and_words_bolder():
    """text_stroke keeps each item's kind, label and colour (shapes untouched), inks more pixels,
    stays inside the box, and the bold digit still matches its own bold template."""
    plain, bold = procedural_items(40, seed=5, kinds=("digit", "text")), procedural_items(
        40, seed=5, kinds=("digit", "text"), text_stroke=2)
    assert [(a.kind, a.label, a.colour, a.qa) for a in plain] == [(b.kind, b.label, b.colour, b.qa) for b in bold]
    templates = {}
    for digit in "0123456789":
        canvas = Image.new("L", (64, 64), 0)
        ImageDraw.Draw(canvas).text((8, 4), digit, font=ImageFont.load_default(size=44), fill=255, stroke_width=2,
                                    stroke_fill=255)
        templates[digit] = glyph(np.asarray(canvas, dtype=np.float64) / 255)
    for a, b in zip(plain, bold):
        mask = ink(b) > 0.5
        x0, y0, x1, y1 = b.box
        assert mask[y0:y1, x0:x1].sum() == mask.sum() > 1.3 * (ink(a) > 0.5).sum()
        if b.kind == "digit":
            assert min(templates, key=lambda d: np.sum((templates[d] - glyph(ink(b))) ** 2)) == b.label
    shapes = procedural_items(10, seed=5, kinds=("shape",))
    assert [i.image.tobytes() for i in shapes] == [i.image.tobytes() for i in procedural_items(
        10, seed=5, kinds=("shape",), text_stroke=2)]
    with pytest.raises(ConfigError, match="text_stroke: must be >= 0"):
        procedural_item(0, text_stroke=-1)


def test_words_are_drawn_inside_their_box():
    for item in procedural_items(20, seed=7, kinds=("text",)):
        mask = ink(item) > 0.5
        x0, y0, x1, y1 = item.box
        assert mask[y0:y1, x0:x1].sum() == mask.sum() > 20
        assert item.caption == f'the word "{item.label}"' and item.qa == (("what does the text say?", item.label),)


def test_procedural_arguments_are_checked():
    with pytest.raises(ConfigError, match="size: procedural images need at least 32 pixels"):
        procedural_item(0, size=16)
    with pytest.raises(ConfigError, match=r"kinds: unknown procedural image kind\(s\) \['photo'\]"):
        procedural_item(0, kinds=("shape", "photo"))
