"""The served schema's ``size`` pattern states exactly the sizes the engine accepts, also when
the pixel budget binds before the model's side limits (checked against the engine's own rule)."""

import itertools
import re

from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import RequestLimits
from diffserve.entrypoints.openai.protocol import request_json_schema


class _Spec:
    """A model spec with sides up to 64 px in steps of 8; every optional default unset."""

    resolution_factor, max_width, max_height = 8, 64, 64

    def __getattr__(self, name):
        return None


def _accepts(width: int, height: int, limits: RequestLimits) -> bool:
    spec = _Spec()
    if width % 8 or height % 8 or width > spec.max_width or height > spec.max_height:
        return False
    return width * height <= limits.max_pixels


def _size_pattern(schema: dict) -> re.Pattern:
    (branch,) = [b for b in schema["properties"]["size"]["anyOf"] if b.get("type") != "null"]
    return re.compile(branch["pattern"])


def test_size_pattern_is_exact_when_the_pixel_budget_binds():
    limits = RequestLimits(max_pixels=32 * 32)
    pattern = _size_pattern(request_json_schema(_Spec(), limits))
    assert pattern.fullmatch("auto")
    for width, height in itertools.product(range(0, 80, 4), repeat=2):
        assert bool(pattern.fullmatch(f"{width}x{height}")) == (width > 0 and height > 0
                                                                 and _accepts(width, height, limits)), (width, height)
    assert not pattern.fullmatch("620006x8")


def test_size_pattern_spells_out_sides_when_the_budget_does_not_bind():
    pattern = _size_pattern(request_json_schema(_Spec(), RequestLimits()))
    assert pattern.fullmatch("64x8") and pattern.fullmatch("8X64") and not pattern.fullmatch("72x8")
