"""Encoding PIL images to PNG, JPEG or WebP bytes (and base64) for API responses, with their
generation metadata (`diffserve.media.metadata`): PNG text chunks, or EXIF + XMP."""

from __future__ import annotations

import base64
import io
import logging

from PIL import Image, PngImagePlugin

from diffserve.media.metadata import exif_user_comment, xmp_packet

logger = logging.getLogger(__name__)

#: Media type of each output format.
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
#: Quality used for jpeg/webp when the request gives no ``output_compression`` (OpenAI's default).
DEFAULT_COMPRESSION = 100
#: Largest EXIF / XMP payload a JPEG APP1 segment holds (64 KiB less its length field and header).
_MAX_APP1_BYTES = 65_000


def encode_image(image: Image.Image, output_format: str = "png", compression: int | None = None,
                 metadata: dict[str, str] | None = None) -> bytes:
    """Encode `image` with Pillow.

    Args:
        output_format: ``"png"`` (lossless; `compression` is ignored), ``"jpeg"`` or ``"webp"``.
        compression: 0-100, the jpeg/webp encoder quality (100 = best quality and largest file,
            the default as in OpenAI's API). None = `DEFAULT_COMPRESSION`.
        metadata: generation metadata (`diffserve.media.metadata.image_metadata`): PNG text
            chunks (every key), or for JPEG / WebP an EXIF ``UserComment`` with
            ``metadata["parameters"]`` and an XMP packet with both (each left out, with a
            warning, when it exceeds the 64 KiB a JPEG segment holds); None = none.

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
        info = None
        if metadata:
            info = PngImagePlugin.PngInfo()
            for key, value in metadata.items():
                info.add_text(key, value)  # iTXt (UTF-8) when the text is not Latin-1
        image.save(buffer, format="PNG", pnginfo=info)
    else:
        if image.mode not in ("RGB", "L"):
            image = image.convert("RGB")
        extra = {}
        if metadata:
            exif, xmp = exif_user_comment(metadata["parameters"]), xmp_packet(metadata)
            for key, payload in (("exif", exif), ("xmp", xmp)):
                if len(payload) <= _MAX_APP1_BYTES:
                    extra[key] = payload
                else:
                    logger.warning("image metadata left out of the %s %s: %d bytes (a JPEG segment holds 64 KiB)",
                                   output_format, key.upper(), len(payload))
        image.save(buffer, format="JPEG" if output_format == "jpeg" else "WEBP", quality=quality, **extra)
    return buffer.getvalue()


def to_base64(data: bytes) -> str:
    """Standard base64 (with padding) of `data`, as a str for JSON."""
    return base64.b64encode(data).decode("ascii")
