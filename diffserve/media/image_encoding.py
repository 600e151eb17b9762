"""Encoding PIL images to PNG, JPEG or WebP bytes (and base64) for API responses."""

from __future__ import annotations

import base64
import io

from PIL import Image

#: Media type of each output format.
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
#: Quality used for jpeg/webp when the request gives no ``output_compression`` (OpenAI's default).
DEFAULT_COMPRESSION = 100


def encode_image(image: Image.Image, output_format: str = "png", compression: int | None = None) -> bytes:
    """Encode `image` with Pillow.

    Args:
        output_format: ``"png"`` (lossless; `compression` is ignored), ``"jpeg"`` or ``"webp"``.
        compression: 0-100, the jpeg/webp encoder quality (100 = best quality and largest file,
            the default as in OpenAI's API). None = `DEFAULT_COMPRESSION`.

    Returns:
        The encoded file's bytes.

    Raises:
        ValueError: unknown `output_format`, or `compression` outside 0-100.
    """
    if output_format not in MEDIA_TYPES:
        raise ValueError(f"unsupported output format {output_format!r}: one of {', '.join(MEDIA_TYPES)}")
    quality = DEFAULT_COMPRESSION if compression is None else compression
    if not 0 <= quality <= 100:
        raise ValueError(f"compression {quality} outside 0-100")
    buffer = io.BytesIO()
    if output_format == "png":
        image.save(buffer, format="PNG")
    else:
        if image.mode not in ("RGB", "L"):
            image = image.convert("RGB")
        image.save(buffer, format="JPEG" if output_format == "jpeg" else "WEBP", quality=quality)
    return buffer.getvalue()


def to_base64(data: bytes) -> str:
    """Standard base64 (with padding) of `data`, as a str for JSON."""
    return base64.b64encode(data).decode("ascii")
