"""An embedded image-text source: rendered shapes, digits and words with verifiable captions (issue 22).

Every multimodal phase must run on CPU with no download (issue 22, "Data"), and a tiny model
trained on it must answer held-out "what shape / digit is this?" questions above chance. This
module draws such images with Pillow, each with a caption and question/answer pairs whose truth
can be checked from the pixels (``tests/data/test_images.py`` does):

* ``shape`` — a filled circle, square, triangle, diamond or cross in a named colour:
  "a red circle", "an orange cross"; Q "what shape is this?" A "circle", Q "what colour is the shape?" A "red";
* ``digit`` — one digit 0-9 in Pillow's built-in font: "the digit 7"; Q "what digit is this?";
* ``text`` — a three-letter word: 'the word "cat"'; Q "what does the text say?".

Objects vary in size and place and sit on a random pale background (every channel >= 200),
while every named colour has a channel <= 50, so object and background never meet in colour.
``text_stroke`` (``data.procedural_text_stroke``; default 0) draws digits and words that many
pixels bolder, for a vision tower whose patches are as wide as the font's thin strokes.
Item ``i`` of seed ``s`` depends on ``(s, i)`` only (its own string-seeded RNG, independent of
``PYTHONHASHSEED`` and of how many items are drawn): a held-out split is another seed or
another index range. Images are RGB Pillow images or, with ``as_array=True``, uint8 ``[H, W, 3]``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

from megatron_s2.config.schema import ConfigError

__all__ = ["KINDS", "SHAPES", "COLOURS", "WORDS", "ProceduralItem", "procedural_item", "procedural_items"]

KINDS: tuple[str, ...] = ("shape", "digit", "text")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20),
    "purple": (130, 40, 170), "orange": (240, 130, 20), "black": (20, 20, 20),
}
"""Named object colours; each has a channel <= 50, below every background channel (>= 200)."""
WORDS: tuple[str, ...] = ("cat", "dog", "sun", "map", "box", "key", "cup", "pen", "owl", "fox", "hat", "bus")
MIN_SIZE = 32
"""Smallest image side: a digit or a three-letter word must stay legible."""


@dataclass(frozen=True)
class ProceduralItem:
    """One rendered image with its caption, question/answer pairs and ground truth."""

    image: Any
    """RGB Pillow image, or uint8 array [size, size, 3] with ``as_array=True``."""
    caption: str
    qa: tuple[tuple[str, str], ...]
    """(question, answer) pairs the image answers, e.g. ("what shape is this?", "circle")."""
    kind: str
    """"shape", "digit" or "text"."""
    label: str
    """The shape name, the digit or the word drawn."""
    colour: str
    """Key of :data:`COLOURS` the object is drawn in."""
    box: tuple[int, int, int, int]
    """Bounding box (x0, y0, x1, y1) of the object, x1 / y1 exclusive."""


def _pillow() -> tuple[Any, Any, Any]:
    from megatron_s2.data.images import require_pillow

    Image, _ = require_pillow()  # the one-line "install pillow" error when absent
    from PIL import ImageDraw, ImageFont

    return Image, ImageDraw, ImageFont


def _shape_outline(shape: str, cx: int, cy: int, r: int) -> list[tuple[str, Any]]:
    """Draw calls (method, coordinates) of a filled shape of half-extent ``r`` centred at (cx, cy)."""
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        return [("ellipse", box)]
    if shape == "square":
        return [("rectangle", box)]
    if shape == "triangle":
        return [("polygon", [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)])]
    if shape == "diamond":
        return [("polygon", [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)])]
    arm = max(1, r // 3)  # cross: two bars a third of the extent thick
    return [("rectangle", (cx - arm, cy - r, cx + arm, cy + r)), ("rectangle", (cx - r, cy - arm, cx + r, cy + arm))]


def _draw_shape(draw: Any, rng: random.Random, size: int, fill: tuple[int, int, int]) -> tuple[str, tuple]:
    shape = rng.choice(SHAPES)
    r = rng.randint(size // 5, size * 7 // 20)
    cx, cy = rng.randint(r + 1, size - r - 2), rng.randint(r + 1, size - r - 2)
    for method, coords in _shape_outline(shape, cx, cy, r):
        getattr(draw, method)(coords, fill=fill)
    return shape, (cx - r, cy - r, cx + r + 1, cy + r + 1)


def _draw_text(draw: Any, rng: random.Random, size: int, fill: tuple[int, int, int], text: str,
               ImageFont: Any, scale: tuple[float, float], stroke: int = 0) -> tuple[int, int, int, int]:
    """Draw ``text`` as large as ``scale`` allows, at a random place where it fits whole; ``stroke``
    pixels of outline in the same colour thicken every stroke (the box includes them)."""
    font_px = int(size * rng.uniform(*scale))
    while True:  # shrink until the text fits with a 2-pixel margin
        font = ImageFont.load_default(size=font_px)
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font, stroke_width=stroke)
        if x1 - x0 <= size - 4 and y1 - y0 <= size - 4 or font_px <= 6:
            break
        font_px -= 1
    if x1 - x0 > size - 4 or y1 - y0 > size - 4:  # data.procedural_text_stroke bounds it; this guards other fonts
        raise ConfigError(f"procedural_text_stroke: {stroke} pixels is too bold for {size}-pixel images "
                          f"('{text}' does not fit at the smallest font); lower it or raise image_size")
    x = rng.randint(2, size - 2 - (x1 - x0)) - x0
    y = rng.randint(2, size - 2 - (y1 - y0)) - y0
    draw.text((x, y), text, font=font, fill=fill, stroke_width=stroke, stroke_fill=fill)
    return x + x0, y + y0, x + x1, y + y1


def procedural_item(index: int, *, seed: int = 0, size: int = 64, kinds: Sequence[str] = KINDS,
                    as_array: bool = False, text_stroke: int = 0) -> ProceduralItem:
    """Item ``index`` of the source seeded ``seed`` (module docstring); ``text_stroke`` > 0 draws
    digits and words that many pixels bolder (same draws of kind, colour, size and place)."""
    if text_stroke < 0:
        raise ConfigError(f"text_stroke: must be >= 0 pixels, got {text_stroke}")
    if size < MIN_SIZE:
        raise ConfigError(f"size: procedural images need at least {MIN_SIZE} pixels a side, got {size}")
    unknown = sorted(set(kinds) - set(KINDS)) or ([] if kinds else ["(none)"])
    if unknown:
        raise ConfigError(f"kinds: unknown procedural image kind(s) {unknown}; choose from {list(KINDS)}")
    Image, ImageDraw, ImageFont = _pillow()
    rng = random.Random(f"procedural-images/{seed}/{index}")  # str seeds hash with SHA-512: stable
    background = tuple(rng.randint(200, 255) for _ in range(3))
    kind, colour = rng.choice(list(kinds)), rng.choice(list(COLOURS))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    if kind == "shape":
        label, box = _draw_shape(draw, rng, size, COLOURS[colour])
        caption = f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {label}"
        qa = (("what shape is this?", label), ("what colour is the shape?", colour))
    elif kind == "digit":
        label = str(rng.randrange(10))
        box = _draw_text(draw, rng, size, COLOURS[colour], label, ImageFont, (0.5, 0.8), text_stroke)
        caption = f"the digit {label}"
        qa = (("what digit is this?", label), ("what colour is the digit?", colour))
    else:
        label = rng.choice(WORDS)
        box = _draw_text(draw, rng, size, COLOURS[colour], label, ImageFont, (0.3, 0.45), text_stroke)
        caption = f'the word "{label}"'
        qa = (("what does the text say?", label),)
    if as_array:
        import numpy as np

        image = np.asarray(image, dtype=np.uint8).copy()
    return ProceduralItem(image, caption, qa, kind, label, colour, box)


def procedural_items(n: int, *, seed: int = 0, start: int = 0, size: int = 64, kinds: Sequence[str] = KINDS,
                     as_array: bool = False, text_stroke: int = 0) -> list[ProceduralItem]:
    """Items ``start .. start + n - 1`` of the source seeded ``seed``."""
    return [procedural_item(i, seed=seed, size=size, kinds=kinds, as_array=as_array, text_stroke=text_stroke)
            for i in range(start, start + n)]
