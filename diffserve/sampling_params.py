"""`SamplingParams`: the per-request generation knobs, and their validation.

Validation happens once, when a request is added, against two sets of facts: the model's
(`ModelSpec`: resolution factor, defaults, whether it is text-conditioned) and the engine's
limits (`RequestLimits`). Every failure raises `InvalidRequestError` naming the field, the value
and the allowed range, before any tensor is allocated.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from dataclasses import dataclass

from diffserve.errors import InvalidRequestError

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
MAX_SEED = 2**63 - 1
#: Guidance beyond this overflows the CFG extrapolation into NaN images; real use is 1-20.
MAX_GUIDANCE_SCALE = 100.0


@dataclass(frozen=True)
class ModelSpec:
    """What a loaded model allows and defaults to (reported by its pipeline adapter).

    Attributes:
        resolution_factor: height and width must be positive multiples of this many pixels
            (VAE spatial down-sampling x transformer patch size; 16 for SD3).
        default_height / default_width: pixels used when a request gives none.
        default_num_inference_steps / default_guidance_scale: used when a request gives none.
        text_conditioned: whether an empty prompt is meaningless (rejected).
        max_prompt_tokens: the text encoder's token limit; longer prompts are truncated.
        max_height / max_width: largest size in pixels the denoiser supports (e.g. SD3's
            positional-embedding grid); None = no model limit.
    """

    resolution_factor: int
    default_height: int
    default_width: int
    default_num_inference_steps: int
    default_guidance_scale: float
    text_conditioned: bool = True
    max_prompt_tokens: int | None = None
    max_height: int | None = None
    max_width: int | None = None


@dataclass(frozen=True)
class RequestLimits:
    """Engine-side limits on a single request (from `EngineConfig`)."""

    max_num_inference_steps: int = 200
    max_pixels: int = 2048 * 2048
    max_num_images_per_prompt: int = 10


@dataclass
class SamplingParams:
    """Generation parameters of one request (one prompt, `num_images_per_prompt` images).

    Any field left ``None`` takes the model's default (see `ModelSpec`) when the request is
    added. The prompt itself is passed next to the params (as in vLLM), not inside them.

    Attributes:
        negative_prompt: text for the unconditional CFG branch (``""`` when None); ignored
            when CFG is off.
        num_images_per_prompt: images generated for the prompt, 1..limit.
        height / width: output size in pixels; positive multiples of the model's resolution
            factor with height*width <= the engine's max pixel count.
        num_inference_steps: denoising steps, 1..limit; N runs exactly N transformer passes
            per CFG branch.
        guidance_scale: classifier-free guidance weight (Ho & Salimans 2022), in [0, 100];
            CFG is on when > 1 (as in diffusers).
        seed: integer in [0, 2**63-1]. The same seed gives byte-identical output on the same
            machine and thread count; None draws a random seed that is reported in the output.
        output_type: ``"pil"`` (list of PIL images), ``"np"`` (float32 array
            (N, H, W, C) in [0, 1]), ``"pt"`` (float tensor (N, C, H, W) in [0, 1]) or
            ``"latent"`` (the final latents (N, C, H/f, W/f)).
    """

    negative_prompt: str | None = None
    num_images_per_prompt: int = 1
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    output_type: str = "pil"

    @property
    def do_classifier_free_guidance(self) -> bool:
        """True when the guidance scale turns CFG on (> 1), doubling the transformer rows."""
        return self.guidance_scale is not None and self.guidance_scale > 1.0

    def resolve(
        self,
        spec: ModelSpec,
        limits: RequestLimits,
        default_seed: int | None = None,
    ) -> "SamplingParams":
        """Return a validated copy with every ``None`` filled from the model's defaults.

        Raises:
            InvalidRequestError: a field is out of range; the message names it and the range.
        """
        p = dataclasses.replace(self)
        for name in ("num_images_per_prompt", "height", "width", "num_inference_steps", "seed"):
            setattr(p, name, _as_int(getattr(p, name)))  # numpy / torch integer scalars welcome
        if isinstance(p.guidance_scale, numbers.Real) and not isinstance(p.guidance_scale, bool):
            p.guidance_scale = float(p.guidance_scale)
        if p.height is None:
            p.height = spec.default_height
        if p.width is None:
            p.width = spec.default_width
        if p.num_inference_steps is None:
            p.num_inference_steps = min(spec.default_num_inference_steps, limits.max_num_inference_steps)
        if p.guidance_scale is None:
            p.guidance_scale = spec.default_guidance_scale
        if p.seed is None:
            p.seed = default_seed if default_seed is not None else secrets.randbelow(2**31)

        _check_int("num_inference_steps", p.num_inference_steps, 1, limits.max_num_inference_steps)
        _check_int("num_images_per_prompt", p.num_images_per_prompt, 1, limits.max_num_images_per_prompt)
        f = spec.resolution_factor
        for name, limit in (("height", spec.max_height), ("width", spec.max_width)):
            value = getattr(p, name)
            allowed = f"a positive multiple of {f} pixels (the model's VAE scale x patch size)"
            if limit is not None:
                allowed += f", at most {limit} pixels for this model"
            if not _is_int(value) or value <= 0 or value % f or (limit is not None and value > limit):
                raise InvalidRequestError(name, value, allowed)
        pixels = p.height * p.width
        if pixels > limits.max_pixels:
            raise InvalidRequestError(
                "size",
                f"{p.width}x{p.height}",
                f"at most {limits.max_pixels} pixels (width x height)",
            )
        g = p.guidance_scale
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) \
                or not 0 <= g <= MAX_GUIDANCE_SCALE:
            raise InvalidRequestError("guidance_scale", g, f"a finite number in [0, {MAX_GUIDANCE_SCALE:g}]")
        p.guidance_scale = float(g)
        _check_int("seed", p.seed, 0, MAX_SEED)
        if p.output_type not in OUTPUT_TYPES:
            raise InvalidRequestError("output_type", p.output_type, f"one of {', '.join(OUTPUT_TYPES)}")
        if p.negative_prompt is not None:
            _check_text("negative_prompt", p.negative_prompt, "a string or null")
        return p


def validate_prompt(prompt: object, spec: ModelSpec | None = None) -> str:
    """Check a prompt and return it.

    Args:
        prompt: the prompt.
        spec: the model's spec; None (no model loaded yet) checks it as for a text-conditioned
            model.

    Raises:
        InvalidRequestError: not a string, not valid Unicode, containing NUL or another control
            character (tab, newline and carriage return are allowed), or empty/whitespace for a
            text-conditioned model.
    """
    _check_text("prompt", prompt, "a string")
    if (spec is None or spec.text_conditioned) and not prompt.strip():
        raise InvalidRequestError("prompt", prompt, "a non-empty, non-whitespace string")
    return prompt


#: Control characters allowed in prompts: ordinary whitespace.
_ALLOWED_CONTROL_CHARS = frozenset("\t\n\r")


def _check_text(field: str, value: object, allowed: str) -> None:
    """Raise `InvalidRequestError` naming `field` unless `value` is a str of valid Unicode text
    without NUL or other control characters (Unicode category Cc: U+0000-U+001F, U+007F-U+009F)
    besides tab, newline and carriage return."""
    if not isinstance(value, str):
        raise InvalidRequestError(field, value, allowed)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(field, value, "valid Unicode text (no lone surrogates)") from None
    for index, char in enumerate(value):
        code = ord(char)
        if (code < 0x20 or 0x7F <= code <= 0x9F) and char not in _ALLOWED_CONTROL_CHARS:
            raise InvalidRequestError(field, value, "text without NUL or control characters (tab, newline "
                                      "and carriage return are allowed)",
                                      detail=f"U+{code:04X} at character {index}")


def _as_int(value: object) -> object:
    """Integral scalars (numpy, torch) as plain ints; anything else unchanged for the checks."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: str, value: object, low: int, high: int) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise InvalidRequestError(field, value, f"an integer in [{low}, {high}]")
