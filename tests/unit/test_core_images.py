"""rein.core.images: what every path that takes an image refuses, and with which words."""

from __future__ import annotations

import io
import struct
import zlib

import pytest
from PIL import Image

from rein.core.images import ImageError, ImageInput, image_sha256, open_image

pytestmark = pytest.mark.unit


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height, with one row of pixel data: a bomb's shape
    (its pixels are never decoded when the cap refuses it first)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)   # 8-bit greyscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1))) + chunk(b"IEND", b""))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_each_taken_format_opens_as_rgb(fmt):
    image = open_image(encoded(Image.new("RGB", (12, 7), (200, 10, 10)), fmt))
    assert (image.mode, image.size) == ("RGB", (12, 7))


def test_a_greyscale_or_transparent_image_becomes_rgb():
    assert open_image(encoded(Image.new("LA", (4, 4)))).mode == "RGB"


def test_a_format_not_taken_is_refused_by_name():
    with pytest.raises(ImageError, match="ICO format are not taken; send one of PNG"):
        open_image(encoded(Image.new("RGB", (8, 8)), "ICO"), param="messages[0].content[1]")


@pytest.mark.parametrize("data", [b"plain text, not an image", b"\x89PNG\r\n\x1a\n"])
def test_what_is_not_an_image_is_refused(data):
    with pytest.raises(ImageError, match="not an image rein can read"):
        open_image(data)


def test_a_truncated_image_is_refused_as_corrupt():
    whole = encoded(Image.effect_noise((64, 64), 40).convert("RGB"))
    with pytest.raises(ImageError, match="corrupt or truncated"):
        open_image(whole[: len(whole) // 2])


def test_a_bomb_is_refused_by_its_declared_size_before_decoding():
    bomb = png_declaring(20_000, 20_000)    # 400 megapixels in a few hundred bytes
    assert len(bomb) < 50_000
    with pytest.raises(ImageError, match="the limit is 64,000,000 pixels"):
        open_image(bomb)
    # Under Pillow's own guard too: rein's cap is the one that speaks.
    with pytest.raises(ImageError, match=r"5000x3000 \(15,000,000 pixels\); the limit is 1,000,000 pixels"):
        open_image(png_declaring(5000, 3000), max_pixels=1_000_000)


def test_too_many_bytes_and_no_bytes_are_refused():
    with pytest.raises(ImageError, match="the limit is 100 bytes") as refused:
        open_image(encoded(Image.effect_noise((64, 64), 40)), max_bytes=100, param="image")
    assert refused.value.param == "image"
    with pytest.raises(ImageError, match="empty"):
        open_image(b"")


def test_an_image_is_named_by_the_sha256_of_its_bytes():
    red, blue = encoded(Image.new("RGB", (4, 4), "red")), encoded(Image.new("RGB", (4, 4), "blue"))
    assert ImageInput.of(red).sha256 == image_sha256(red) == ImageInput.of(red, "low").sha256
    assert ImageInput.of(red).sha256 != ImageInput.of(blue).sha256
    assert ImageInput.of(red, None).detail == "auto"
    with pytest.raises(ImageError, match="detail must be one of auto, low, high"):
        ImageInput.of(red, "ultra")
