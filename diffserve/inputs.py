"""Request inputs besides the prompt: input images and an optional mask (image-to-image,
edits, inpainting), normalised once at the API boundary.

Images travel as PIL images (RGB; masks as mode ``"L"``), the form diffusers' image processors
take, so a request's pre-processing (resizing, normalisation) is exactly the diffusers
pipeline's. Offline callers may pass PIL images, numpy arrays (H, W, 3) / (H, W) uint8 or float
in [0, 1], or tensors (3, H, W) / (H, W) in [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from diffserve.errors import InvalidRequestError
from diffserve.pipelines.base import RequestInputs

#: Largest input image accepted, in pixels (width x height).
MAX_INPUT_PIXELS = 4096 * 4096
#: Most input images per request.
MAX_INPUT_IMAGES = 16


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


def make_inputs(images: Any = None, mask: Any = None) -> RequestInputs | None:
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
        if pil_mask.size != pils[0].size:
            raise InvalidRequestError("mask", f"{pil_mask.size[0]}x{pil_mask.size[1]}",
                                      f"the image's size {pils[0].size[0]}x{pils[0].size[1]}")
    return RequestInputs(images=pils, mask=pil_mask)
