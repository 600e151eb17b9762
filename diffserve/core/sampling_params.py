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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diffserve.core.errors import InvalidRequestError

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
MAX_SEED = 2**63 - 1
#: Values of `SamplingParams.cache_quality`, from no skipping to the most skipping.
CACHE_QUALITY_LEVELS = ("max", "high", "balanced", "fast")
#: Guidance beyond this overflows the CFG extrapolation into NaN images; real use is 1-20.
MAX_GUIDANCE_SCALE = 100.0
#: Largest |scale| of a LoRA adapter in a request (diffusers' ``set_adapters`` weight; real use
#: is 0-1.5, negative scales subtract a style).
MAX_LORA_SCALE = 4.0
#: Per-request sampler names (``SamplingParams.scheduler``) -> AUTOMATIC1111's sampler and
#: schedule type (what its infotext records), in the order of the table in
#: `diffserve.pipelines.samplers`, which maps each to a diffusers scheduler.
A1111_SAMPLERS: dict[str, tuple[str, str | None]] = {
    "euler": ("Euler", None), "euler_a": ("Euler a", None), "dpmpp_2m": ("DPM++ 2M", None),
    "dpmpp_2m_karras": ("DPM++ 2M", "Karras"), "dpmpp_sde": ("DPM++ SDE", None), "ddim": ("DDIM", None),
    "unipc": ("UniPC", None), "lcm": ("LCM", None),
}
SAMPLER_NAMES = tuple(A1111_SAMPLERS)
#: `SamplingParams.priority` range: [-MAX_PRIORITY - 1, MAX_PRIORITY] (a signed 32-bit integer).
MAX_PRIORITY = 2**31 - 1


@dataclass(frozen=True)
class ModelSpec:
    """What a loaded model allows and defaults to (reported by its pipeline adapter).

    A ``default_*`` of None means the model does not use that field: a request that sets it
    gets an `InvalidRequestError` naming it (never silently ignored).

    Attributes:
        resolution_factor: height and width must be positive multiples of this many pixels
            (VAE spatial down-sampling x transformer patch size; 16 for SD3).
        default_height / default_width: pixels used when a request gives none.
        default_num_inference_steps: used when a request gives none.
        default_guidance_scale: ``guidance_scale`` default (CFG weight, or Flux-dev's embedded
            guidance); None = not used by this model.
        default_true_cfg_scale: ``true_cfg_scale`` default (Flux / Qwen-Image true CFG with a
            negative prompt); None = not used.
        default_guidance_scale_2: ``guidance_scale_2`` default (the CFG weight of the
            low-noise expert of two-expert models, Wan 2.2); None = not used. A request that
            sets ``guidance_scale`` but not ``guidance_scale_2`` gets its ``guidance_scale`` for
            both experts, as diffusers' ``WanPipeline`` does.
        default_max_sequence_length / max_sequence_length_limit: text-encoder token budget
            (T5 / Qwen / UMT5) and its largest allowed value; None = not used.
        text_conditioned: whether the model takes a prompt: an empty one is meaningless
            (rejected); a model that takes none (an unconditional pipeline) refuses a non-empty
            one as unused.
        max_prompt_tokens: the text encoder's token limit; longer prompts are truncated.
        max_height / max_width: largest size in pixels the denoiser supports (e.g. SD3's
            positional-embedding grid); None = no model limit.
        pipeline: the diffusers pipeline class name (for messages).
        default_num_frames: frames of a video model (None = an image model, ``num_frames``
            not used); ``frame_factor`` k: num_frames must be k*m + 1 (Wan: 4); max_num_frames.
        default_fps: frames per second of the output video.
        accepts_images: the model takes input images (image-to-image / edit).
        requires_images: every request needs an input image (an edit-only model: no
            text-to-image).
        max_input_images: most input images a request may give (with `accepts_images`).
        accepts_mask: the model takes a mask with its input image (inpainting).
        default_strength: img2img strength default (None = not used).
        extra_parameters: names ``SamplingParams.extra`` may set: the pipeline's own
            ``__call__`` arguments beyond the fields above (whole-request pipelines, e.g. PAG's
            ``pag_scale``); None = ``extra`` is not accepted (step adapters).
        samplers: the ``scheduler`` names a request may pick (`diffserve.pipelines.samplers`);
            None = per-request samplers are not supported (the folder's scheduler only).
        image_samplers: those of `samplers` a request with an input image may pick (SD3
            image-to-image: the ones that can noise an image); None = all of `samplers`.
        max_clip_skip: largest ``clip_skip`` (CLIP text encoders' layers - 1); None = the
            model has no CLIP text encoder that takes it.
    """

    resolution_factor: int
    default_height: int
    default_width: int
    default_num_inference_steps: int
    default_guidance_scale: float | None
    default_true_cfg_scale: float | None = None
    default_guidance_scale_2: float | None = None
    default_max_sequence_length: int | None = None
    max_sequence_length_limit: int | None = None
    text_conditioned: bool = True
    max_prompt_tokens: int | None = None
    max_height: int | None = None
    max_width: int | None = None
    pipeline: str = "this model"
    default_num_frames: int | None = None
    frame_factor: int = 1
    max_num_frames: int | None = None
    default_fps: int | None = None
    accepts_images: bool = False
    requires_images: bool = False
    max_input_images: int = 1
    accepts_mask: bool = False
    default_strength: float | None = None
    extra_parameters: tuple[str, ...] | None = None
    samplers: tuple[str, ...] | None = None
    image_samplers: tuple[str, ...] | None = None
    max_clip_skip: int | None = None


@dataclass(frozen=True)
class RequestLimits:
    """Engine-side limits on a single request (from `EngineConfig`)."""

    max_num_inference_steps: int = 200
    max_pixels: int = 2048 * 2048
    max_num_images_per_prompt: int = 10
    max_num_frames: int = 1025
    max_num_chunks: int = 1024


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
        guidance_scale: as the family's diffusers ``__call__`` means it, in [0, 100]: the
            classifier-free guidance weight (Ho & Salimans 2022; CFG on when > 1) for SD / SDXL
            / SD3 / Wan, the embedded guidance input for guidance-distilled Flux-dev.
        true_cfg_scale: true-CFG weight with a real negative branch (Flux, Qwen-Image; on when
            > 1 and a negative prompt is given, as in diffusers), in [0, 100].
        guidance_scale_2: CFG weight of the low-noise expert of two-expert models (Wan 2.2:
            steps with timestep below the boundary), in [0, 100]; default: this request's
            ``guidance_scale`` when it sets one, else the model's default. Whether CFG runs at
            all follows ``guidance_scale`` (diffusers' rule).
        max_sequence_length: token budget of the long text encoder (T5 / Qwen / UMT5).
        num_frames / fps: video length in frames and playback rate (video models only). With
            ``num_chunks`` set, ``num_frames`` is the length of ONE chunk (the model's window).
        num_chunks: makes the request a stream (video models whose adapter can chunk, see
            `diffserve.pipelines.video_chunks`): ``num_chunks`` chunks of ``num_frames``
            frames are generated one after the other, each conditioned on the end of the
            previous one; each is decoded and emitted as a ``chunk`` event as soon as it is
            done, and the prompt of the following chunks can be changed while it runs
            (`DiffusionEngine.submit_interaction`). An integer in [1, limit]; None = one
            ordinary generation. Streams make one video (``num_images_per_prompt`` 1) of
            decoded frames (``output_type`` not ``"latent"``).
        strength: image-to-image strength in (0, 1]: the fraction of the schedule run on the
            noised input image (requests with an input image only; None = the model's
            default, e.g. diffusers' 0.6 for SD3 img2img).
        seed: integer in [0, 2**63-1]. The same seed gives byte-identical output on the same
            machine and thread count; None draws a random seed that is reported in the output.
            Image ``i`` of the request is drawn from seed ``(seed + i) mod 2**63``
            (`image_seeds`), so each image equals the one-image request with that seed, as
            the CLI's ``-n`` and the HTTP ``n`` make them.
        loras: LoRA adapters to apply, ``{name: scale}`` (several compose, as diffusers'
            ``set_adapters(names, weights)``): names of adapters the engine holds
            (`DiffusionEngine.load_lora`, ``--lora``, ``--lora-dir``, a built-in model's own),
            scales finite in [-4, 4]; None = none. Requests with different adapters share
            denoiser forwards (each row adds its own low-rank deltas).
        cache_quality: this request's quality budget for step caching (engines run with a
            cache backend, ``--cache-backend teacache``), one of `CACHE_QUALITY_LEVELS`:
            ``"max"`` never skips a transformer step (the uncached result); ``"high"``,
            ``"balanced"`` and ``"fast"`` skip steps (their output forecast from computed ones)
            under a run-time guard that computes a step whenever the request's estimated
            accumulated error would exceed the level's budget. Each level is a measured error
            budget (``diffserve/acceleration/cache_quality.py``); the PSNR each gives on the
            built-in model is in the README (Acceleration: quality levels). None = the
            engine's default (its ``cache_config`` ``cache_quality``). Requests with different
            levels share denoiser forwards.
        output_type: ``"pil"`` (list of PIL images), ``"np"`` (float32 array
            (N, H, W, C) in [0, 1]), ``"pt"`` (float tensor (N, C, H, W) in [0, 1]) or
            ``"latent"`` (the final latents (N, C, H/f, W/f)).
        scheduler: the sampler (diffusion scheduler) this request runs with, by name: ``euler``,
            ``euler_a``, ``dpmpp_2m``, ``dpmpp_2m_karras``, ``dpmpp_sde``, ``ddim``, ``unipc``,
            ``lcm`` (AUTOMATIC1111's samplers, each a diffusers scheduler class + config
            overrides: `diffserve.pipelines.samplers`), those in ``ModelSpec.samplers``; None
            = the model folder's own scheduler. Requests with different samplers share
            denoiser forwards.
        clip_skip: CLIP layers skipped from the end for the prompt embeddings, as diffusers'
            ``clip_skip`` (1 = the pre-final layer: AUTOMATIC1111's "Clip skip: 2"), in [1,
            ``ModelSpec.max_clip_skip``]; CLIP families (SD 1.x/2.x, SDXL, SD3); None = none.
        eta: DDIM's eta in [0, 1] (0 = deterministic DDIM, 1 = DDPM-like noise), for
            schedulers whose step takes it (``scheduler="ddim"``, or a DDIM folder) in families
            that pass it (SD 1.x/2.x, SDXL); None = 0.
        extra: further ``__call__`` arguments of a pipeline served whole-request (the
            fallback for classes without a step adapter), by name, e.g. ``{"pag_scale": 3.0}``;
            only names in the model's ``ModelSpec.extra_parameters`` (checked when the request
            is added; the HTTP field ``extra_params``, the CLI's ``--extra KEY=JSON``).
        priority: an integer in [-2**31, 2**31 - 1]; LOWER values are served first (vLLM's
            convention) under the ``priority`` scheduling policy and break ties under ``slo``;
            unused (accepted) under ``fcfs``. Default 0.
        deadline_s: seconds from arrival by which the request should finish (its SLO), a
            positive finite number; the ``slo`` policy orders steps by least slack and
            ``--admission slo`` refuses a request that cannot meet it. Under other policies it
            is only counted (SLO attainment). None: no deadline.
    """

    negative_prompt: str | None = None
    num_images_per_prompt: int = 1
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    guidance_scale_2: float | None = None
    max_sequence_length: int | None = None
    seed: int | None = None
    output_type: str = "pil"
    num_frames: int | None = None
    fps: int | None = None
    strength: float | None = None
    num_chunks: int | None = None
    extra: dict[str, Any] | None = None
    loras: dict[str, float] | None = None
    cache_quality: str | None = None
    scheduler: str | None = None
    clip_skip: int | None = None
    eta: float | None = None
    priority: int = 0
    deadline_s: float | None = None

    def image_seeds(self) -> list[int]:
        """The seed of each of the ``num_images_per_prompt`` images: `image_seed` (`seed`, i).

        Raises:
            ValueError: `seed` is None (resolve the params first).
        """
        if self.seed is None:
            raise ValueError("image_seeds needs a seed: resolve the params first")
        return [image_seed(self.seed, i) for i in range(self.num_images_per_prompt)]

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
        for name in ("num_images_per_prompt", "height", "width", "num_inference_steps", "seed",
                     "max_sequence_length", "num_frames", "fps", "num_chunks", "clip_skip", "priority"):
            setattr(p, name, _as_int(getattr(p, name)))  # numpy / torch integer scalars welcome
        for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2", "strength", "eta", "deadline_s"):
            value = getattr(p, name)
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                setattr(p, name, as_float(value))
        if p.height is None:
            p.height = spec.default_height
        if p.width is None:
            p.width = spec.default_width
        if p.num_inference_steps is None:
            p.num_inference_steps = min(spec.default_num_inference_steps, limits.max_num_inference_steps)
        if p.seed is None:
            p.seed = default_seed if default_seed is not None else secrets.randbelow(2**31)
        if p.guidance_scale_2 is None and p.guidance_scale is not None \
                and spec.default_guidance_scale_2 is not None:
            p.guidance_scale_2 = p.guidance_scale  # diffusers: guidance_scale_2 follows guidance_scale
        p.guidance_scale = _default_or_refuse(spec, "guidance_scale", p.guidance_scale,
                                              spec.default_guidance_scale, "no guidance scale")
        p.guidance_scale_2 = _default_or_refuse(spec, "guidance_scale_2", p.guidance_scale_2,
                                                spec.default_guidance_scale_2, "no second (low-noise) expert")
        p.true_cfg_scale = _default_or_refuse(spec, "true_cfg_scale", p.true_cfg_scale,
                                              spec.default_true_cfg_scale, "no true CFG")
        p.max_sequence_length = _default_or_refuse(
            spec, "max_sequence_length", p.max_sequence_length, spec.default_max_sequence_length,
            "no long text encoder with a sequence-length setting")
        p.num_frames = _default_or_refuse(spec, "num_frames", p.num_frames, spec.default_num_frames,
                                          "an image model (no frames)")
        p.fps = _default_or_refuse(spec, "fps", p.fps, spec.default_fps, "an image model (no fps)")
        if p.num_chunks is not None and spec.default_num_frames is None:
            raise InvalidRequestError("num_chunks", p.num_chunks, f"unset: {spec.pipeline} is an image model "
                                      "(no video chunks)")
        if p.strength is not None:  # left None when absent: only image inputs use a default
            _default_or_refuse(spec, "strength", p.strength, spec.default_strength, "no image inputs (no strength)")

        _check_int("priority", p.priority, -MAX_PRIORITY - 1, MAX_PRIORITY)
        if p.deadline_s is not None and not (isinstance(p.deadline_s, float) and math.isfinite(p.deadline_s)
                                             and p.deadline_s > 0):
            raise InvalidRequestError("deadline_s", p.deadline_s, "a positive finite number of seconds from arrival "
                                      "(or null: no deadline)")
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
        for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2"):
            g = getattr(p, name)
            if g is None:
                continue
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) \
                    or not 0 <= g <= MAX_GUIDANCE_SCALE:
                raise InvalidRequestError(name, g, f"a finite number in [0, {MAX_GUIDANCE_SCALE:g}]")
            setattr(p, name, float(g))
        if p.max_sequence_length is not None:
            _check_int("max_sequence_length", p.max_sequence_length, 1,
                       spec.max_sequence_length_limit or p.max_sequence_length)
        if p.num_frames is not None:
            k = spec.frame_factor
            top = min(spec.max_num_frames or limits.max_num_frames, limits.max_num_frames)
            if not _is_int(p.num_frames) or not 1 <= p.num_frames <= top or (p.num_frames - 1) % k:
                rule = f" of the form {k}*m + 1" if k > 1 else ""
                raise InvalidRequestError("num_frames", p.num_frames, f"an integer{rule} in [1, {top}]")
        if p.fps is not None:
            _check_int("fps", p.fps, 1, 240)
        if p.num_chunks is not None:
            _check_int("num_chunks", p.num_chunks, 1, limits.max_num_chunks)
            if p.num_images_per_prompt != 1:
                raise InvalidRequestError("num_images_per_prompt", p.num_images_per_prompt,
                                          "1 with num_chunks (a stream is one video)")
            if p.output_type == "latent":
                raise InvalidRequestError("output_type", p.output_type,
                                          "one of pil, np, pt with num_chunks (chunks are decoded frames)")
        if p.strength is not None:
            s = p.strength
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or not 0 < s <= 1:
                raise InvalidRequestError("strength", s, "a number in (0, 1]")
            p.strength = float(s)
        _check_int("seed", p.seed, 0, MAX_SEED)
        if p.output_type not in OUTPUT_TYPES:
            raise InvalidRequestError("output_type", p.output_type, f"one of {', '.join(OUTPUT_TYPES)}")
        if p.negative_prompt is not None:
            _check_text("negative_prompt", p.negative_prompt, "a string or null")
        if p.extra is not None:
            _check_extra(spec, p.extra)
            p.extra = dict(p.extra) or None
        p.loras = check_loras(p.loras)
        if p.cache_quality is not None and p.cache_quality not in CACHE_QUALITY_LEVELS:
            raise InvalidRequestError("cache_quality", p.cache_quality,
                                      f"one of {', '.join(CACHE_QUALITY_LEVELS)} (or unset: the engine's default)")
        _check_sampling(spec, p)
        return p


def _check_sampling(spec: ModelSpec, p: "SamplingParams") -> None:
    """``scheduler``, ``clip_skip`` and ``eta`` against the model (whether ``eta`` applies to
    the request's scheduler is the family's check, `PipelineAdapter.check_params`).

    Raises:
        InvalidRequestError: naming the field and what it allows.
    """
    if p.scheduler is not None:
        if spec.samplers is None:
            raise InvalidRequestError("scheduler", p.scheduler, f"unset: {spec.pipeline} runs with its folder's "
                                      "scheduler only (no per-request samplers)")
        if p.scheduler not in spec.samplers:
            raise InvalidRequestError("scheduler", p.scheduler, f"one of {', '.join(spec.samplers)} (the samplers "
                                      f"{spec.pipeline} supports), or null for the folder's own")
    if p.clip_skip is not None:
        if spec.max_clip_skip is None:
            raise InvalidRequestError("clip_skip", p.clip_skip, f"unset: {spec.pipeline} has no CLIP text encoder "
                                      "that takes it")
        _check_int("clip_skip", p.clip_skip, 1, spec.max_clip_skip)
    if p.eta is not None:
        if isinstance(p.eta, bool) or not isinstance(p.eta, float) or not math.isfinite(p.eta) \
                or not 0 <= p.eta <= 1:
            raise InvalidRequestError("eta", p.eta, "a number in [0, 1]")


def _check_extra(spec: ModelSpec, extra: object) -> None:
    """Raise `InvalidRequestError` (field ``extra``) unless `extra` is a dict whose keys are all
    in ``spec.extra_parameters`` (the unknown names are listed)."""
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise InvalidRequestError("extra", extra, "an object of pipeline __call__ arguments by name")
    if not extra:
        return
    if spec.extra_parameters is None:
        raise InvalidRequestError("extra", sorted(extra), f"unset: {spec.pipeline} runs with step batching and takes "
                                  "only diffserve's fields (extra parameters apply to pipelines served "
                                  "whole-request)")
    unknown = sorted(k for k in extra if k not in spec.extra_parameters)
    if unknown:
        allowed = ", ".join(spec.extra_parameters) or "none"
        raise InvalidRequestError("extra", unknown, f"names of {spec.pipeline}.__call__ arguments diffserve does not "
                                  f"set itself: {allowed}")


def check_loras(loras: object) -> dict[str, float] | None:
    """A request's ``loras`` as ``{name: float scale}`` (None / empty: none).

    Raises:
        InvalidRequestError: (field ``loras``) not a mapping of non-empty string names to
            finite numbers in [-MAX_LORA_SCALE, MAX_LORA_SCALE].
    """
    if loras is None:
        return None
    allowed = (f"a mapping of LoRA names to finite scales in [{-MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}] "
               "(e.g. {\"mirror\": 1.0})")
    if not isinstance(loras, Mapping):
        raise InvalidRequestError("loras", loras, allowed)
    out: dict[str, float] = {}
    for name, scale in loras.items():
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("loras", dict(loras), allowed, detail=f"name {name!r}")
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) \
                or not -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE:
            raise InvalidRequestError("loras", dict(loras), allowed, detail=f"scale of {name!r} is {scale!r}")
        out[name] = float(scale)
    return out or None


def _default_or_refuse(spec: ModelSpec, field: str, value, default, what: str):
    """The request's value, or the model's default when None; refuse a value the model has no
    use for (its default is None)."""
    if value is None:
        return default
    if default is None:
        raise InvalidRequestError(field, value, f"unset: {spec.pipeline} has {what}")
    return value


def validate_prompt(prompt: object, spec: ModelSpec | None = None) -> str:
    """Check a prompt and return it.

    Args:
        prompt: the prompt.
        spec: the model's spec; None (no model loaded yet) checks it as for a text-conditioned
            model.

    Raises:
        InvalidRequestError: not a string, not valid Unicode, containing NUL or another control
            character (tab, newline and carriage return are allowed), empty/whitespace for a
            text-conditioned model, or not empty for a model that takes no prompt.
    """
    _check_text("prompt", prompt, "a string")
    if (spec is None or spec.text_conditioned) and not prompt.strip():
        raise InvalidRequestError("prompt", prompt, "a non-empty, non-whitespace string")
    if spec is not None and not spec.text_conditioned and prompt.strip():
        raise InvalidRequestError("prompt", prompt, f"empty: {spec.pipeline} takes no prompt (an unconditional "
                                  "model), so the text would be unused")
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


def as_float(value: numbers.Real) -> float:
    """`value` as a float; an integer too large for one (``float(10**400)`` raises
    OverflowError) becomes +-inf, which the finite-range checks then refuse naming the field."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


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


def image_seed(seed: int, index: int) -> int:
    """The seed of image `index` (0-based) of a request with `seed`: ``(seed + index) mod
    2**63``. One rule for every interface (offline ``num_images_per_prompt``, the CLI's ``-n``,
    the HTTP ``n``), so each image is reproducible alone with its own seed."""
    return (seed + index) % (MAX_SEED + 1)
