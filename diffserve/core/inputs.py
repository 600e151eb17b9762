"""Request inputs besides the prompt: input images and an optional mask (image-to-image,
edits, inpainting), normalised once at the API boundary.

Images travel as PIL images (RGB; masks as mode ``"L"``), the form diffusers' image processors
take, so a request's pre-processing (resizing, normalisation) is exactly the diffusers
pipeline's. Offline callers may pass PIL images, numpy arrays (H, W, 3) / (H, W) uint8 or float
in [0, 1], or tensors (3, H, W) / (H, W) in [0, 1]. Image files (the CLI's ``--image``, the HTTP
edit uploads) are decoded by `read_image` (PNG, JPEG or WebP), masks by `mask_from_image`.

Importing this module does not import torch (the CLI checks input files before loading it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from diffserve.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL import Image

#: Largest input image accepted, in pixels (width x height).
MAX_INPUT_PIXELS = 4096 * 4096
#: Most input images per request.
MAX_INPUT_IMAGES = 16
#: Largest input image file, bytes (OpenAI's limit for edit inputs: 50 MB).
MAX_IMAGE_FILE_BYTES = 50 * 10**6
#: Image file encodings accepted (PIL format name -> name used in messages).
IMAGE_FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP"}


@dataclass
class RequestInputs:
    """Non-text inputs of a request (image-to-image, edits, inpainting); build them with
    `make_inputs`.

    Attributes:
        images: input images as RGB PIL images (what diffusers' image processors take), one or
            several.
        mask: optional mode-"L" PIL image of the first image's size; white = repaint.
    """

    images: list[Any] = field(default_factory=list)
    mask: Any = None


def read_image(data: bytes, field: str) -> "Image.Image":
    """Decode an image file (PNG, JPEG or WebP), EXIF orientation applied.

    The size is checked from the file's header, before its pixels are decoded.

    Args:
        data: the file's bytes.
        field: the request field (or CLI option) it came from, for errors.

    Raises:
        InvalidRequestError: naming `field`: over `MAX_IMAGE_FILE_BYTES`, not a readable PNG,
            JPEG or WebP file (unknown format, truncated, corrupt), or over `MAX_INPUT_PIXELS`.
    """
    import io
    import warnings

    from PIL import Image, ImageOps, UnidentifiedImageError

    allowed = "a PNG, JPEG or WebP image"
    if len(data) > MAX_IMAGE_FILE_BYTES:
        raise InvalidRequestError(field, f"a file of {len(data)} bytes", f"at most {MAX_IMAGE_FILE_BYTES} bytes")
    if not data:
        raise InvalidRequestError(field, "an empty file", allowed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the pixel limit below is ours
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            raise InvalidRequestError(field, "an image of too many pixels", f"at most {MAX_INPUT_PIXELS} pixels") \
                from None
        except UnidentifiedImageError:
            raise InvalidRequestError(field, "an unreadable file", allowed, detail="not an image file") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise InvalidRequestError(field, "an unreadable file", allowed, detail=str(exc) or None) from None
        if image.format not in IMAGE_FORMATS:
            raise InvalidRequestError(field, f"a {image.format} image", allowed)
        width, height = image.size
        if width * height > MAX_INPUT_PIXELS:
            raise InvalidRequestError(field, f"{width}x{height}", f"at most {MAX_INPUT_PIXELS} pixels")
        try:
            image.load()
            return ImageOps.exif_transpose(image)
        except (OSError, ValueError, SyntaxError) as exc:
            raise InvalidRequestError(field, f"an unreadable {IMAGE_FORMATS[image.format]} file", allowed,
                                      detail=str(exc) or None) from None


def mask_from_image(image: "Image.Image") -> "Image.Image":
    """A mask (mode ``"L"``, white = repaint) from a mask image: OpenAI's convention when it has
    transparency (fully transparent pixels are edited: mask = 255 - alpha), else its luminance
    (white = repaint, diffusers' convention)."""
    from PIL import ImageOps

    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return ImageOps.invert(image.convert("RGBA").getchannel("A"))
    return image.convert("L")


def check_mask_size(image_size: tuple[int, int], mask_size: tuple[int, int]) -> None:
    """Raise `InvalidRequestError` naming ``mask`` unless the mask has the first image's size."""
    if mask_size != image_size:
        raise InvalidRequestError("mask", f"{mask_size[0]}x{mask_size[1]}",
                                  f"the image's size {image_size[0]}x{image_size[1]}")


def to_pil(value: Any, field: str, mode: str):
    """One image as a PIL image of `mode` (``"RGB"`` or ``"L"``).

    Raises:
        InvalidRequestError: not an image, wrong shape/range, empty, or over `MAX_INPUT_PIXELS`.
    """
    from PIL import Image

    if isinstance(value, Image.Image):
        image = value
    else:
        array = value
        if hasattr(value, "detach"):  # torch tensor (C, H, W) or (H, W)
            array = value.detach().cpu().float().numpy()
            if array.ndim == 3 and array.shape[0] in (1, 3, 4):
                array = array.transpose(1, 2, 0)
        if not isinstance(array, np.ndarray):
            raise InvalidRequestError(field, type(value).__name__, "a PIL image, a numpy array or a torch tensor")
        if array.ndim == 3 and array.shape[-1] == 1:
            array = array[..., 0]
        if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
            raise InvalidRequestError(field, f"array of shape {array.shape}", "(H, W), (H, W, 3) or (H, W, 4)")
        if array.dtype != np.uint8:
            if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
                raise InvalidRequestError(field, "float array", "values in [0, 1] (or a uint8 array)")
            array = (array * 255).round().astype(np.uint8)
        image = Image.fromarray(array)
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidRequestError(field, f"{width}x{height}", "a non-empty image")
    if width * height > MAX_INPUT_PIXELS:
        raise InvalidRequestError(field, f"{width}x{height}", f"at most {MAX_INPUT_PIXELS} pixels")
    if image.mode != mode:
        image = image.convert(mode)
    return image


def make_inputs(images: Any = None, mask: Any = None) -> "RequestInputs | None":
    """Normalise offline/HTTP image inputs into `RequestInputs` (None when there are none).

    Args:
        images: one image or a sequence of them (see the module docstring for the forms).
        mask: optional mask of the first image's size; white (1) = repaint.

    Raises:
        InvalidRequestError: naming ``image`` / ``mask``: unreadable, too large, too many,
            a mask without an image, or a mask whose size differs from the image's.
    """
    if images is None and mask is None:
        return None
    if images is None:
        raise InvalidRequestError("mask", "<mask>", "given together with an image")
    if isinstance(images, RequestInputs):
        return images
    if not isinstance(images, Sequence) or isinstance(images, (str, bytes)) or isinstance(images, np.ndarray):
        images = [images]
    if not images:
        return None if mask is None else make_inputs(None, mask)
    if len(images) > MAX_INPUT_IMAGES:
        raise InvalidRequestError("image", f"{len(images)} images", f"at most {MAX_INPUT_IMAGES} images")
    pils = [to_pil(image, "image", "RGB") for image in images]
    pil_mask = None
    if mask is not None:
        pil_mask = to_pil(mask, "mask", "L")
        check_mask_size(pils[0].size, pil_mask.size)
    return RequestInputs(images=pils, mask=pil_mask)


def auto_size(image_size: tuple[int, int], spec, limits) -> tuple[int, int]:
    """The output size of an edit whose ``size`` is ``"auto"``: the input image's size, scaled
    down (aspect ratio kept) when it exceeds the model's largest width/height or the engine's
    pixel limit, each side rounded to the nearest multiple of the model's resolution factor (at
    least one multiple, never over the limits).

    Args:
        image_size: (width, height) of the input image, pixels.
        spec: the model's `ModelSpec` (``resolution_factor``, ``max_width``, ``max_height``).
        limits: the engine's `RequestLimits` (``max_pixels``).

    Returns:
        (width, height) in pixels, valid for the model.
    """
    width, height = image_size
    f = spec.resolution_factor
    scale = min(1.0, math.sqrt(limits.max_pixels / (width * height)))
    if spec.max_width is not None:
        scale = min(scale, spec.max_width / width)
    if spec.max_height is not None:
        scale = min(scale, spec.max_height / height)

    def side(pixels: int, top: int | None) -> int:
        value = max(1, round(pixels * scale / f)) * f
        return value if top is None else max(f, min(value, top // f * f))

    out_w, out_h = side(width, spec.max_width), side(height, spec.max_height)
    while out_w * out_h > limits.max_pixels and max(out_w, out_h) > f:  # rounding up may overshoot
        if out_w >= out_h:
            out_w -= f
        else:
            out_h -= f
    return out_w, out_h
