"""Schemas of the OpenAI-compatible Images and Videos APIs, plus diffserve's extension fields.

JSON requests are validated strictly: unknown fields are rejected (``extra="forbid"``) and types
are not coerced (``"n": "3"`` or ``"n": 1.5`` is a 400); as in JSON Schema, an integral number
such as ``2.0`` is the integer 2. Form requests (``multipart/form-data``: image edits, and video
jobs as the ``openai`` client sends them) carry text, so their values are coerced (``"3"`` is the
integer 3); unknown fields are rejected there too. Ranges that depend on the
loaded model or the engine's limits (``n``, ``size``, ``num_inference_steps``) are checked when
the request is turned into `SamplingParams`, before anything is queued.

OpenAI fields (see OpenAI's ``POST /v1/images/generations``):
    prompt, model, n, size, response_format, output_format, output_compression, stream,
    partial_images, user, safety_identifier; and quality, style, background, moderation,
    complexity, which are validated against OpenAI's documented values and otherwise ignored
    (except ``background="transparent"``, rejected: the models output opaque RGB).

diffserve extension fields (send them with the openai client's ``extra_body=``):
    negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, seed; and stream_progress
    (with stream=true: also send the ``diffserve.queued`` / ``diffserve.progress`` events of
    `diffserve.entrypoints.openai.services.sse_progress`); edits add strength (`ImageEditRequest`),
    videos their own (`VideoCreateRequest`).

``GET /v1/models`` cards carry diffserve extensions (`ModelCard`): ``capabilities`` (what the
model does, hence which endpoints serve it) and ``parameters`` (the request parameters it takes,
with defaults and ranges), so a client such as the web playground can build its form from them;
``quantization`` (the quantized components: method, kept layers, bytes).
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, field_validator, model_serializer

from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import (
    CACHE_QUALITY_LEVELS,
    MAX_GUIDANCE_SCALE,
    MAX_LORA_SCALE,
    MAX_SEED,
    SAMPLER_NAMES,
    as_float,
)

if TYPE_CHECKING:
    from diffserve.core.sampling_params import ModelSpec, RequestLimits
    from diffserve.engine.client import EngineClient

#: Longest accepted prompt / negative prompt, in characters (OpenAI's limit).
MAX_PROMPT_CHARS = 32000
#: Output encodings this server writes.
OUTPUT_FORMATS = ("png", "jpeg", "webp")
#: Most partial images a streamed request may ask for (OpenAI's limit).
MAX_PARTIAL_IMAGES = 3

_SIZE_RE = re.compile(r"([0-9]{1,6})[xX]([0-9]{1,6})")
#: The ``size`` field's syntax (the loaded model's sizes are in the served OpenAPI schema).
SIZE_PATTERN = r"^(auto|[0-9]{1,6}[xX][0-9]{1,6})$"
#: Prompt text as enforced: at least one non-whitespace character, no control characters other
#: than tab, newline and carriage return (see `diffserve.core.sampling_params.validate_prompt`).
PROMPT_PATTERN = (r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]*[^\s\x00-\x1f\x7f-\x9f]"
                  r"[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]*$")
#: Negative prompt text as enforced (may be empty or blank).
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]*$"
#: Seeds are below this (``exclusiveMaximum`` in the schema): 2**63 is exact in a double, while
#: 2**63 - 1 (`MAX_SEED`) rounds to it, so JSON-Schema tools working in doubles would disagree
#: with the server about the largest seed.
SEED_BOUND = MAX_SEED + 1
#: Least ``strength`` of an edit: any above it leaves at least one denoising step at any step
#: count (diffusers counts N - int(N - N x strength) steps; far below it that rounds to none).
MIN_STRENGTH = 1e-6
#: Longest video a request may ask for in ``seconds`` (the model's frame limit may be lower).
MAX_VIDEO_SECONDS = 3600
#: Largest number of size alternatives spelled out in the served schema's ``size`` pattern.
MAX_SCHEMA_SIDES = 512
#: Longest ``size`` pattern the served schema spells out pair by pair (characters).
MAX_SIZE_PATTERN_CHARS = 65536


def _schema_null_only(schema: dict[str, Any]) -> None:
    """Schema of a field that must be null (accepted for compatibility, not supported)."""
    for key in ("anyOf", "type", "additionalProperties"):
        schema.pop(key, None)
    schema["type"] = "null"


def _schema_enum(*values: str):
    """Schema edit: the field's string branch allows only `values`."""
    def edit(schema: dict[str, Any]) -> None:
        for branch in schema.get("anyOf", [schema]):
            if "enum" in branch:
                branch["enum"] = list(values)
    return edit


class _StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


#: The ``loras`` extension field of generation requests (images, edits, videos, video streams).
LORAS_DESCRIPTION = ("LoRA adapters to apply, {name: scale} (GET /v1/loras lists the names; several compose, as "
                     "diffusers' set_adapters); scales finite in [-4, 4]; in a multipart form, a JSON object")

#: The ``priority`` / ``deadline_s`` extension fields of generation requests.
PRIORITY_DESCRIPTION = ("scheduling priority, a 32-bit integer: LOWER values are served first under the server's "
                        "--scheduling-policy priority (ties under slo); accepted and unused under fcfs. Default 0")
DEADLINE_DESCRIPTION = ("seconds from arrival by which the request should finish (its SLO), > 0: --scheduling-policy "
                        "slo serves least slack first and --admission slo refuses (429 deadline_unmeetable) what "
                        "it predicts cannot make it; under other policies only counted (SLO attainment)")
PRIORITY_BOUND = 2**31

#: The ``loras`` field's type: non-empty names to finite scales in [-4, 4] (the served schema
#: states both, so a schema-valid request is refused only for a name the server does not hold: 404).
LoraScales = dict[Annotated[str, StringConstraints(min_length=1, max_length=128)],
                  Annotated[float, Field(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)]]

#: The ``scheduler`` field's type. The schema lists the sampler names (the served one narrows
#: them to the model's, `_sampling_schema`), but any value passes here: the engine's check
#: (`SamplingParams.validate`) refuses a name or value the model does not take with a 400 that
#: lists the model's own samplers, where pydantic's would list all of `SAMPLER_NAMES`.
SamplerName = Annotated[Any, WithJsonSchema({"type": "string", "enum": list(SAMPLER_NAMES)})]


#: The ``cache_quality`` extension field of generation requests (`SamplingParams.cache_quality`).
CACHE_QUALITY_DESCRIPTION = ("step-caching quality budget: max (no skipping), high, balanced, fast (measured error "
                             "budgets; the server's default from --cache-config); with --cache-backend teacache, "
                             "else only max")
CacheQuality = Literal["max", "high", "balanced", "fast"]
assert tuple(CacheQuality.__args__) == CACHE_QUALITY_LEVELS


def served_cache_qualities(config: Any) -> list[str] | None:
    """The ``cache_quality`` values an engine with `config` accepts: every level with the
    ``teacache`` backend, only ``max`` without a cache backend, none (the field is refused)
    with ``cache_dit``."""
    if config.cache_backend == "teacache":
        return list(CACHE_QUALITY_LEVELS)
    return ["max"] if config.cache_backend == "none" else None


def loras_from_text(value: Any) -> Any:
    """A ``loras`` form field (text) as the JSON object it holds; other values unchanged.

    Raises:
        ValueError: text that is not a JSON object.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError('must be a JSON object of LoRA names to scales, e.g. {"mirror": 1.0}') from None
        if not isinstance(value, dict):
            raise ValueError('must be a JSON object of LoRA names to scales, e.g. {"mirror": 1.0}')
    return value


class _ImageRequest(_StrictRequest):
    """The fields ``POST /v1/images/generations`` and ``POST /v1/images/edits`` share (OpenAI's
    and diffserve's extensions). Every field but ``prompt`` is optional; ``null`` means "not
    given"."""

    prompt: str = Field(max_length=MAX_PROMPT_CHARS, description="text description of the image: at least one "
                        "non-whitespace character; no control characters but tab, newline, carriage return",
                        json_schema_extra={"minLength": 1, "pattern": PROMPT_PATTERN})
    model: str | None = Field(None, description="the served model's name (GET /v1/models); optional")
    n: int | None = Field(None, ge=1, description="images to generate, 1..the engine's limit (10 by default; "
                                                   "at most the server's waiting-queue bound)")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" in pixels, or "auto" (generations: the model '
                                               "default; edits: the input image's size rounded to the model's "
                                               "multiple)",
                             json_schema_extra={"pattern": SIZE_PATTERN})
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description='"b64_json" (default) or "url": a link served by this server for a limited time')
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(
        None, ge=0, le=100,
        description="0-100; for jpeg/webp the encoder quality (100 = best, the default); png is lossless "
                    "and ignores it")
    quality: Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"] | None = Field(
        None, description="accepted for compatibility and ignored: use num_inference_steps")
    background: Literal["auto", "opaque", "transparent"] | None = Field(
        None, description='"auto" or "opaque"; "transparent" is rejected (the models output RGB)',
        json_schema_extra=_schema_enum("auto", "opaque"))
    complexity: Literal["low", "medium", "high"] | None = Field(
        None, description="accepted for compatibility and ignored")
    user: str | None = Field(None, max_length=256, description="end-user id (logged only)")
    safety_identifier: str | None = Field(None, max_length=256, description="end-user id (logged only)")
    stream: bool | None = Field(None, description="stream Server-Sent Events instead of one JSON response")
    partial_images: int | None = Field(
        None, ge=0, le=MAX_PARTIAL_IMAGES,
        description="with stream=true: previews of the current latents sent before the final image (0-3)")
    # OpenAI fields that only apply to output formats this server does not write.
    frame_count: int | None = Field(None, description="GIF only: not supported (must be null)",
                                    json_schema_extra=_schema_null_only)
    frame_duration_ms: int | None = Field(None, description="GIF only: not supported (must be null)",
                                          json_schema_extra=_schema_null_only)
    svg: dict[str, Any] | None = Field(None, description="SVG only: not supported (must be null)",
                                       json_schema_extra=_schema_null_only)
    # diffserve extensions.
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS,
                                        description="text for the unconditional CFG branch (no control "
                                                    "characters but tab, newline, carriage return)",
                                        json_schema_extra={"pattern": TEXT_PATTERN})
    num_inference_steps: int | None = Field(None, description="denoising steps, 1..the engine's limit",
                                            json_schema_extra={"minimum": 1})
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False,
                                         description="classifier-free guidance weight; CFG is on when > 1")
    true_cfg_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False,
                                         description="true-CFG weight (Flux, Qwen-Image): on when > 1 and a "
                                                     "negative_prompt is given")
    seed: int | None = Field(
        None, ge=0, lt=SEED_BOUND,
        description="seed of the first image; image i uses (seed + i) mod 2**63, so each image is "
                    "reproducible alone")
    stream_progress: bool | None = Field(
        None, description="with stream=true: also send diffserve.queued (place in the waiting queue) and "
                          "diffserve.progress (denoising steps done) events, and diffserve.ar_delta "
                          "(multi-stage models: each new piece of the AR stage's text) events")
    loras: LoraScales | None = Field(None, description=LORAS_DESCRIPTION)
    cache_quality: CacheQuality | None = Field(None, description=CACHE_QUALITY_DESCRIPTION)
    scheduler: SamplerName | None = Field(
        None, description="sampler (A1111's names, each a diffusers scheduler: README 'Samplers'); the model card's "
                          "scheduler parameter lists those the model offers; null = the model folder's own")
    clip_skip: int | None = Field(None, ge=1, description="CLIP layers skipped from the end for the prompt "
                                                          "embeddings (diffusers' clip_skip; SD, SDXL, SD3)")
    eta: float | None = Field(None, ge=0, le=1, allow_inf_nan=False,
                              description="DDIM eta (scheduler ddim; SD, SDXL)")
    extra_params: dict[str, Any] | None = Field(
        None, description="further __call__ arguments of a pipeline served whole-request (no step adapter), by "
                          "name, e.g. {\"pag_scale\": 3.0}; the model card's extra_parameters lists the names "
                          "(unknown names are a 400 naming them); in a form, a JSON object as text")
    priority: int | None = Field(None, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND, description=PRIORITY_DESCRIPTION)
    deadline_s: float | None = Field(None, gt=0, allow_inf_nan=False, description=DEADLINE_DESCRIPTION)

    @field_validator("loras", mode="before")
    @classmethod
    def _loras_from_form_text(cls, value: Any) -> Any:
        return loras_from_text(value)

    @field_validator("extra_params", mode="before")
    @classmethod
    def _json_text_is_an_object(cls, value: Any) -> Any:
        if isinstance(value, str):  # multipart forms carry text
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not a JSON object: {exc}") from None
        return value

    @field_validator("deadline_s", mode="before")
    @classmethod
    def _integer_deadline_is_a_number(cls, value: Any) -> Any:
        return as_float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("n", "output_compression", "partial_images", "num_inference_steps", "seed", "clip_skip",
                     "priority", mode="before")
    @classmethod
    def _integral_numbers_are_integers(cls, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)  # JSON Schema's "integer" is any number without a fraction
        return value

    @field_validator("background")
    @classmethod
    def _opaque_only(cls, value: str | None) -> str | None:
        if value == "transparent":
            raise ValueError("transparent backgrounds are not supported: the models output opaque RGB; "
                             "use 'auto' or 'opaque'")
        return value

    @field_validator("frame_count", "frame_duration_ms", "svg")
    @classmethod
    def _no_gif_or_svg_options(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("must be null: the gif and svg output formats are not supported")
        return value


class ImageGenerationRequest(_ImageRequest):
    """Body of ``POST /v1/images/generations`` (JSON).

    Every field but ``prompt`` is optional; ``null`` means "not given". Defaults: ``n=1``,
    ``size="auto"`` (the model's default size), ``response_format="b64_json"``,
    ``output_format="png"``, ``output_compression=100``, ``stream=false``, ``partial_images=0``;
    ``num_inference_steps`` and ``guidance_scale`` default to the model's values and ``seed`` to
    a random one (reported back per image).
    """

    style: Literal["vivid", "natural"] | None = Field(None, description="accepted for compatibility and ignored")
    moderation: Literal["low", "auto"] | None = Field(
        None, description="accepted for compatibility and ignored (this server does no moderation)")


class ImageEditRequest(_ImageRequest):
    """The text fields of ``POST /v1/images/edits`` (``multipart/form-data``; the files
    ``image`` / ``image[]`` and ``mask`` travel beside them, see
    `diffserve.entrypoints.openai.services.edits`). Form values are text, so they are validated
    with type coercion (``"2"`` is the integer 2, ``"true"`` the boolean).

    Defaults as for generations, except ``size="auto"``: the (first) input image's size
    rounded to the model's resolution multiple (scaled down to fit the model's limits), and
    ``strength``: the model's img2img default.
    """

    strength: float | None = Field(None, ge=MIN_STRENGTH, le=1, allow_inf_nan=False,
                                   description="image-to-image strength: the fraction of the denoising schedule "
                                               "run on the noised input image, at least one step (1e-6 <= s <= 1; "
                                               "default: the model's)")
    input_fidelity: Literal["high", "low"] | None = Field(None, description="accepted for compatibility and "
                                                                            "ignored: use strength")


def parse_size(size: str | None) -> tuple[int, int] | None:
    """Parse the ``size`` field.

    Returns:
        ``(width, height)`` in pixels, or None for ``None``/``"auto"`` (the model's default).

    Raises:
        InvalidRequestError: not ``"auto"`` nor ``"WIDTHxHEIGHT"`` with 1-6 digits each (the
            model's multiple-of and the engine's max-pixels rules are checked later).
    """
    if size is None or size == "auto":
        return None
    match = _SIZE_RE.fullmatch(size)
    if match is None:
        raise InvalidRequestError("size", size, '"auto" or "WIDTHxHEIGHT" in pixels, e.g. "512x512"')
    return int(match.group(1)), int(match.group(2))


def sse_event_schema(events: list[str], payloads: list[str] | None = None,
                     description: str = "") -> dict[str, Any]:
    """Schema of one event of a ``text/event-stream`` response (OpenAPI 3.1: the ``schema`` of
    an event-stream media type describes each event, as schemathesis reads it): its name, one
    of `events`, and its ``data``, one line of JSON, described by the component schemas named
    in `payloads` (`SSE_PAYLOAD_MODELS`; added to the served schema's components)."""
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json"}
    if payloads:
        data["contentSchema"] = {"oneOf": [{"$ref": f"#/components/schemas/{name}"} for name in payloads]}
    if description:
        data["description"] = description
    return {
        "type": "object",
        "description": "One Server-Sent Event; the stream also carries ': keep-alive' comments",
        "properties": {"event": {"type": "string", "enum": events}, "data": data},
        "required": ["event", "data"],
    }


def image_sse_event_schema(prefix: str = "image_generation") -> dict[str, Any]:
    """`sse_event_schema` of the image generation (`prefix` ``image_generation``) and edit
    (``image_edit``) streams; with ``stream_progress`` they also carry the ``diffserve.queued``
    and ``diffserve.progress`` events."""
    return sse_event_schema([f"{prefix}.partial_image", f"{prefix}.completed", "diffserve.queued",
                             "diffserve.progress", "error"],
                            ["PartialImageEvent", "CompletedEvent", "QueuedEvent", "ProgressEvent", "ErrorEvent"])


#: Schema of one event of the ``POST /v1/images/generations`` stream.
SSE_EVENT_SCHEMA: dict[str, Any] = image_sse_event_schema("image_generation")


#: Request fields a model takes only when its spec has a default for them (`ModelSpec`: a
#: ``default_*`` of None means the model refuses the field).
MODEL_FIELDS = {"guidance_scale": "default_guidance_scale", "true_cfg_scale": "default_true_cfg_scale",
                "guidance_scale_2": "default_guidance_scale_2", "strength": "default_strength",
                "num_frames": "default_num_frames", "fps": "default_fps"}


def request_json_schema(spec: "ModelSpec | None" = None, limits: "RequestLimits | None" = None,
                        max_n: int | None = None, model: type[BaseModel] | None = None,
                        cache_qualities: list[str] | None = CACHE_QUALITY_LEVELS) -> dict[str, Any]:
    """JSON schema of a request body (`model`: `ImageGenerationRequest` by default), stating
    what the server enforces for the loaded model when `spec` and `limits` are given: the
    fields the model does not take are left out (`MODEL_FIELDS`: a request that sends one gets
    400, like any unknown field); ``n`` in [1, max_n]; ``num_inference_steps`` in [1, limit];
    ``num_frames`` as the list of counts the model allows (``k*m + 1`` up to its maximum);
    ``num_chunks`` in [1, limit]; and ``size`` spelled out as the allowed ``WxH`` values
    (multiples of the model's resolution factor up to its maximum, and within ``max_pixels``)
    when there are at most `MAX_SCHEMA_SIDES` per side and the pattern stays within
    `MAX_SIZE_PATTERN_CHARS`; ``cache_quality`` among `cache_qualities`
    (`served_cache_qualities`; None: the field is left out, the engine refuses it)."""
    schema = (model or ImageGenerationRequest).model_json_schema()
    props = schema["properties"]
    if "cache_quality" in props:
        if cache_qualities is None:
            del props["cache_quality"]
        else:
            _constrain(props["cache_quality"], enum=list(cache_qualities))
    if max_n is not None and "n" in props:
        _constrain(props["n"], minimum=1, maximum=max_n)
    if limits is not None:
        _constrain(props["num_inference_steps"], minimum=1, maximum=limits.max_num_inference_steps)
        if "num_chunks" in props:
            _constrain(props["num_chunks"], minimum=1, maximum=limits.max_num_chunks)
    if spec is None or limits is None:
        return schema
    for name, default in MODEL_FIELDS.items():
        if name in props and getattr(spec, default) is None:
            del props[name]
    _sampling_schema(props, spec, images=model is ImageEditRequest)
    if "num_frames" in props:
        top = min(spec.max_num_frames or limits.max_num_frames, limits.max_num_frames)
        allowed = list(range(1, top + 1, spec.frame_factor))
        _constrain(props["num_frames"], **({"enum": allowed} if len(allowed) <= MAX_SCHEMA_SIDES
                                            else {"minimum": 1, "maximum": top}))
    f = spec.resolution_factor
    sides = []
    for side_max in (spec.max_width, spec.max_height):
        top = min(side_max if side_max is not None else limits.max_pixels // f, limits.max_pixels // f)
        sides.append([str(v) for v in range(f, top + 1, f)])
    widths, heights = sides
    if not widths or not heights or max(len(widths), len(heights)) > MAX_SCHEMA_SIDES or "size" not in props:
        return schema
    if int(widths[-1]) * int(heights[-1]) <= limits.max_pixels:
        _constrain(props["size"], pattern=f"^(auto|({'|'.join(widths)})[xX]({'|'.join(heights)}))$")
        return schema
    # the pixel budget binds before the sides do: each width with the heights that fit beside it
    rows = []
    for width in widths:
        fit = [h for h in heights if int(width) * int(h) <= limits.max_pixels]
        if fit:
            rows.append(f"{width}[xX]({'|'.join(fit)})")
    if rows and sum(map(len, rows)) <= MAX_SIZE_PATTERN_CHARS:
        _constrain(props["size"], pattern=f"^(auto|{'|'.join(rows)})$")
    return schema


def seconds_schema(max_seconds: float) -> list[dict[str, Any]]:
    """The non-null branches of the ``seconds`` schema of video requests when at most
    `max_seconds` are allowed: a whole number of seconds as text in [1, floor(max_seconds)]
    (a pattern spelling the range out) and a JSON number in (0, max_seconds]."""
    branches: list[dict[str, Any]] = []
    whole = math.floor(max_seconds)
    if whole >= 1:
        branches.append({"type": "string", "pattern": f"^0*({integer_range_regex(1, whole)})$"})
    branches.append({"type": "number", "exclusiveMinimum": 0, "maximum": max_seconds})
    return branches


def integer_range_regex(low: int, high: int) -> str:
    """A regular expression (an alternation, no anchors) matching the decimal integers in
    [`low`, `high`] written without leading zeros (0 <= low <= high), e.g. ``(1, 31)`` ->
    ``[1-9]|[1-2][0-9]|3[0-1]``."""
    parts: list[str] = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        start = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        end = min(high, 10 ** digits - 1)
        if start <= end:
            parts += _same_length_ranges(str(start), str(end))
    return "|".join(parts)


def _same_length_ranges(low: str, high: str) -> list[str]:
    """Patterns of the integers from `low` to `high`, equally long digit strings."""
    if low == high:
        return [low]
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [low[0] + f"({'|'.join(_same_length_ranges(low[1:], high[1:]))})"]
    rest = len(low) - 1
    parts = [low[0] + f"({'|'.join(_same_length_ranges(low[1:], '9' * rest))})"]
    first, last = int(low[0]) + 1, int(high[0]) - 1
    if first <= last:
        parts.append((str(first) if first == last else f"[{first}-{last}]") + "[0-9]" * rest)
    parts.append(high[0] + f"({'|'.join(_same_length_ranges('0' * rest, high[1:]))})")
    return parts


def _sampling_schema(props: dict[str, Any], spec: "ModelSpec", images: bool = False) -> None:
    """The per-request sampler fields and ``extra_params`` as the model takes them: ``scheduler``
    among the samplers it offers (`images`: with an input image, ``ModelSpec.image_samplers``),
    ``clip_skip`` up to its CLIP layers, ``eta`` only with a DDIM sampler on offer,
    ``extra_params`` with the pipeline's own ``__call__`` names; each left out where the model
    takes none (a request that sends one gets 400, like any unknown field)."""
    offered = {"scheduler": spec.samplers, "clip_skip": spec.max_clip_skip,
               "eta": spec.samplers if spec.samplers and "ddim" in spec.samplers else None,
               "extra_params": spec.extra_parameters or None}
    for name, value in offered.items():
        if name in props and value is None:
            del props[name]
    if "scheduler" in props:
        allowed = spec.image_samplers if images and spec.image_samplers is not None else spec.samplers
        if allowed:
            _constrain(props["scheduler"], enum=list(allowed))
        else:
            del props["scheduler"]
    if "clip_skip" in props:
        _constrain(props["clip_skip"], minimum=1, maximum=spec.max_clip_skip)
    if "extra_params" in props:
        _constrain(props["extra_params"], propertyNames={"enum": list(spec.extra_parameters)})


def _constrain(prop: dict[str, Any], **keywords: Any) -> None:
    """Add `keywords` to a property schema (to its non-null branch when it is ``X | None``)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") != "null":
            branch.update(keywords)


def preview_steps(num_inference_steps: int, partial_images: int) -> list[int]:
    """Denoising steps (1-based) after which a preview is decoded, spread evenly over the run.

    The last step is never used (the final image follows it), so a run of N steps gives at most
    N - 1 previews: a short run may send fewer than `partial_images`, as OpenAI allows.
    """
    if partial_images <= 0 or num_inference_steps <= 1:
        return []
    n = num_inference_steps
    steps = {min(n - 1, max(1, round(n * (j + 1) / (partial_images + 1)))) for j in range(partial_images)}
    return sorted(steps)


# --------------------------------------------------------------------------------- responses
class ImageObject(BaseModel):
    """One generated image (``data[i]``).

    Attributes:
        b64_json / url: the image, per ``response_format``.
        revised_prompt: multi-stage models whose AR stage writes text (the built-in
            ``digits-reasoning``: its language model's answer): that text; else null (prompts
            are used as given).
        seed: diffserve extension: the seed that reproduces this image alone (with ``n=1``).
        prompt_truncated / negative_prompt_truncated: diffserve extensions: the prompt / the
            negative prompt exceeded the text encoder's token limit and was cut (the negative
            prompt only counts where it is used: with guidance on).
        expires_at: diffserve extension (``url`` only): Unix time after which the URL is gone.
        timings: diffserve extension: this image's stage durations in seconds (queue_s,
            encode_s, denoise_s, decode_s, total_s), num_steps, batch_sizes (transformer rows
            per step -> steps run at that size) and peak_memory_bytes; with step caching
            (``--cache-backend teacache``) also cache_quality, cache_skipped_steps,
            cache_error_estimate and cache_check_steps (`RequestMetrics`).
    """

    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    seed: int
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    expires_at: int | None = None
    timings: dict[str, Any]


class ImagesResponse(BaseModel):
    """Response of ``POST /v1/images/generations`` and ``POST /v1/images/edits`` (non-streamed).

    ``id`` (diffserve extension) is unique per HTTP request; the engine requests of its images
    are ``{id}-{i}``. ``created`` is a Unix time in seconds; ``size`` is the actual ``WxH``.
    """

    id: str
    created: int
    data: list[ImageObject]
    size: str
    output_format: str
    background: str = "opaque"
    quality: str | None = None
    usage: dict[str, Any] | None = None


class PartialImageEvent(BaseModel):
    """SSE event ``image_generation.partial_image`` (``image_edit.partial_image`` for edits): a
    decoded preview of the current latents.

    ``image_index`` (diffserve extension) says which of the ``n`` images it belongs to;
    ``partial_image_index`` counts that image's previews from 0.
    """

    type: Literal["image_generation.partial_image", "image_edit.partial_image"] = "image_generation.partial_image"
    b64_json: str
    created_at: int
    size: str
    quality: str
    background: str
    output_format: str
    partial_image_index: int
    image_index: int = 0


class ImageUsageDetails(BaseModel):
    """Input token breakdown (always zero: diffserve does not count tokens)."""

    image_tokens: int = 0
    text_tokens: int = 0


class ImageUsage(BaseModel):
    """OpenAI's token usage block; diffserve does not count tokens, so every count is 0."""

    input_tokens: int = 0
    input_tokens_details: ImageUsageDetails = Field(default_factory=ImageUsageDetails)
    output_tokens: int = 0
    total_tokens: int = 0


class CompletedEvent(BaseModel):
    """SSE event ``image_generation.completed`` (``image_edit.completed`` for edits): one final
    image (one event per image when ``n > 1``). diffserve extensions: ``image_index``,
    ``seed``, ``prompt_truncated``, ``negative_prompt_truncated``, ``timings``, ``revised_prompt``
    (as in `ImageObject`)."""

    type: Literal["image_generation.completed", "image_edit.completed"] = "image_generation.completed"
    b64_json: str
    created_at: int
    size: str
    quality: str
    background: str
    output_format: str
    usage: ImageUsage = Field(default_factory=ImageUsage)
    image_index: int = 0
    seed: int
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    timings: dict[str, Any]
    revised_prompt: str | None = None


# ------------------------------------------------------------------------------- videos
class VideoCreateRequest(_StrictRequest):
    """Body of ``POST /v1/videos`` (OpenAI's Videos API), as ``multipart/form-data`` (what the
    ``openai`` client sends; values are coerced from text) or JSON (strict types).

    OpenAI fields: ``prompt``, ``model``, ``size`` (``"WIDTHxHEIGHT"``), ``seconds`` (clip length;
    converted to frames, see `diffserve.entrypoints.openai.services.videos`); ``input_reference``
    (an image) is refused: the served video models are text-to-video.

    diffserve extensions: ``num_frames`` (instead of ``seconds``), ``fps``, ``seed``,
    ``negative_prompt``, ``num_inference_steps``, ``guidance_scale``, ``guidance_scale_2``,
    ``true_cfg_scale``. Omitted fields take the model's defaults (``seed``: random, reported).
    """

    prompt: str = Field(max_length=MAX_PROMPT_CHARS, description="text description of the video",
                        json_schema_extra={"minLength": 1, "pattern": PROMPT_PATTERN})
    model: str | None = Field(None, description="the served model's name (GET /v1/models); optional")
    size: str | None = Field(None, description='"WIDTHxHEIGHT" in pixels, or "auto" (the model default)',
                             json_schema_extra={"pattern": SIZE_PATTERN})
    seconds: str | float | None = Field(
        None, description="clip length in seconds: a whole number as text (OpenAI's form, e.g. \"4\"; forms "
                          "take only this) or a JSON number; frames = the nearest count the model allows to "
                          "seconds x the model's fps. Give seconds alone: not with num_frames or fps",
        json_schema_extra=lambda schema: schema.update(anyOf=seconds_schema(MAX_VIDEO_SECONDS) + [{"type": "null"}]))
    num_frames: int | None = Field(None, ge=1, description="frames of the video (the model's rule, e.g. 4k+1 "
                                                           "for Wan); default: the model's")
    fps: int | None = Field(None, ge=1, le=240, description="frames per second; default: the model's")
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS,
                                        description="text for the unconditional CFG branch",
                                        json_schema_extra={"pattern": TEXT_PATTERN})
    num_inference_steps: int | None = Field(None, description="denoising steps, 1..the engine's limit",
                                            json_schema_extra={"minimum": 1})
    guidance_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False,
                                         description="classifier-free guidance weight; CFG is on when > 1")
    guidance_scale_2: float | None = Field(None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False,
                                           description="CFG weight of the low-noise expert (Wan 2.2)")
    true_cfg_scale: float | None = Field(None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False,
                                         description="true-CFG weight (models with true CFG)")
    seed: int | None = Field(None, ge=0, lt=SEED_BOUND, description="seed (default: random, reported)")
    loras: LoraScales | None = Field(None, description=LORAS_DESCRIPTION)
    cache_quality: CacheQuality | None = Field(None, description=CACHE_QUALITY_DESCRIPTION)
    scheduler: SamplerName | None = Field(
        None, description="sampler (README 'Samplers'); null = the model folder's own scheduler")
    priority: int | None = Field(None, ge=-PRIORITY_BOUND, lt=PRIORITY_BOUND, description=PRIORITY_DESCRIPTION)
    deadline_s: float | None = Field(None, gt=0, allow_inf_nan=False, description=DEADLINE_DESCRIPTION)

    @field_validator("loras", mode="before")
    @classmethod
    def _loras_from_form_text(cls, value: Any) -> Any:
        return loras_from_text(value)

    @field_validator("deadline_s", mode="before")
    @classmethod
    def _integer_deadline_is_a_number(cls, value: Any) -> Any:
        return as_float(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("num_frames", "fps", "num_inference_steps", "seed", "priority", mode="before")
    @classmethod
    def _integral_numbers_are_integers(cls, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @field_validator("seconds")
    @classmethod
    def _positive_seconds(cls, value: str | float | None) -> float | None:
        if value is None:
            return None
        if isinstance(value, str):
            if not re.fullmatch(r"[0-9]+", value):
                raise ValueError('must be a whole number of seconds as text (e.g. "4"), or a JSON number')
            value = int(value) if len(value) <= 12 else MAX_VIDEO_SECONDS + 1  # never a huge int
        seconds = float(value)
        if not 0 < seconds <= MAX_VIDEO_SECONDS:
            raise ValueError(f"must be a number of seconds in (0, {MAX_VIDEO_SECONDS}]")
        return seconds


class VideoError(BaseModel):
    """Why a video job failed (OpenAI's ``error`` of a video)."""

    code: str
    message: str


class VideoObject(BaseModel):
    """A video job (OpenAI's ``Video`` object), from ``POST /v1/videos`` and
    ``GET /v1/videos/{id}``.

    ``status``: ``queued`` -> ``in_progress`` -> ``completed`` or ``failed``. ``progress`` is the
    percentage of denoising steps done (100 once completed). ``expires_at`` (Unix seconds) is set
    once the job ends: the job and its video stay available until then, always. ``seconds`` is
    the actual length, num_frames / fps.

    diffserve extensions: ``seed``, ``num_frames``, ``fps``, ``num_inference_steps`` and
    ``steps_done`` (progress in steps), ``queue_position`` (1-based place in the engine's
    waiting queue while queued, when the replica that runs the job answers), ``timings``
    (stage durations in seconds, once completed), ``prompt_truncated`` /
    ``negative_prompt_truncated`` (the text exceeded the text encoder's token limit and was cut;
    known once completed).
    """

    id: str
    object: Literal["video"] = "video"
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    progress: int
    prompt: str | None = None
    remixed_from_video_id: str | None = None
    seconds: str
    size: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    error: VideoError | None = None
    seed: int
    num_frames: int
    fps: int
    num_inference_steps: int
    steps_done: int = 0
    queue_position: int | None = None
    timings: dict[str, Any] | None = None
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False


class VideoList(BaseModel):
    """Response of ``GET /v1/videos`` (a cursor page: pass ``last_id`` as ``after``)."""

    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    """Response of ``DELETE /v1/videos/{id}``."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


#: The capabilities a model card may list, and the endpoint each one is served by.
CAPABILITY_ENDPOINTS = {
    "text-to-image": "POST /v1/images/generations",
    "image-edit": "POST /v1/images/edits",
    "text-to-video": "POST /v1/videos",
}


class ParameterInfo(BaseModel):
    """A request parameter a model takes (model card extension), described like a JSON-schema
    property.

    Attributes:
        type: ``integer``, ``number``, ``string``, ``boolean`` or ``object`` (``loras``: a
            mapping whose values are in [minimum, maximum]).
        default: the value used when a request omits the parameter (None: none, or drawn at
            random, e.g. ``seed``).
        minimum / maximum: inclusive range of numeric parameters.
        enum: the values a string parameter takes (``scheduler``: the samplers the model offers).
        multiple_of / max_width / max_height / max_pixels: ``size`` only: width and height in
            pixels are positive multiples of `multiple_of`, at most `max_width` x `max_height`
            (None: no model limit), with width x height <= `max_pixels`.
        capabilities: the capabilities whose requests take the parameter (e.g. ``strength``:
            ``["image-edit"]``); None = every capability of the model.
        description: one line for people.

    Fields that are None are left out of the JSON.
    """

    type: Literal["integer", "number", "string", "boolean", "object"]
    default: int | float | str | bool | None = None
    enum: list[str] | None = None
    minimum: int | float | None = None
    maximum: int | float | None = None
    multiple_of: int | None = None
    max_width: int | None = None
    max_height: int | None = None
    max_pixels: int | None = None
    capabilities: list[str] | None = None
    description: str | None = None

    @model_serializer(mode="wrap")
    def _without_nones(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ComponentQuantization(BaseModel):
    """How one component's weights are quantized (`diffserve.core.quantization.ComponentReport`)."""

    method: str = Field(description="int8_weight_only, int8_dynamic, float8, int4_weight_only; torchao:<Config> "
                                    "for a pre-quantized folder; gguf:<types> for a GGUF file")
    source: str = Field(description="quantized at load, pre-quantized folder or gguf file")
    quantized_layers: int = Field(description="linear layers holding quantized weights")
    kept_layers: list[str] = Field(description="linear layers kept in full precision (component.layer)")
    bytes: int = Field(description="bytes of the component's weights as stored")
    full_precision_bytes: int = Field(description="bytes of the same weights unquantized, in the model dtype")
    ratio: float | None = Field(None, description="bytes / full_precision_bytes")
    error: float | None = Field(None, description="the denoiser output's relative L2 error measured at load by "
                                                  "the automatic skip list")


class QuantizationInfo(BaseModel):
    """The served model's quantized weights (``/v1/models`` extension)."""

    methods: str | dict[str, str | None] | None = Field(description="what was asked: one method or per component")
    skip: str | list[str] | None = Field(description="auto, layer-name patterns, or null")
    error_budget: float = Field(description="the automatic skip list's bound on the relative output error")
    transformer_file: str | None = Field(description="the GGUF transformer file's name, or null")
    components: dict[str, ComponentQuantization]

    @classmethod
    def of(cls, info: dict | None) -> "QuantizationInfo | None":
        """From `ModelInfo.quantization` (None stays None); the GGUF file by name only."""
        if not info:
            return None
        spec = dict(info["spec"])
        if spec.get("transformer_file"):
            spec["transformer_file"] = re.split(r"[\\/]", spec["transformer_file"])[-1]
        return cls(**spec, components=info["components"])


class ModelCard(BaseModel):
    """An entry of ``GET /v1/models``.

    diffserve extensions (None while the model is still loading):
        capabilities: what the model does, each served by one endpoint (`CAPABILITY_ENDPOINTS`):
            ``text-to-image``, ``image-edit``, ``text-to-video``.
        parameters: request parameter name -> `ParameterInfo`, for the parameters this model
            takes beyond ``prompt`` and ``model`` (a parameter a model lacks, e.g.
            ``true_cfg_scale`` without true CFG, is absent).
        step_batching: False when the model's pipeline class has no step adapter and runs
            whole requests without step batching (the whole-request fallback).
        extra_parameters: the names ``extra_params`` may set (the whole-request pipeline's own
            ``__call__`` arguments); absent for step-batched models, which take none.
        loras: the LoRA adapters requests may name in ``loras`` (as ``GET /v1/loras`` lists
            them: name, state, origin, rank, format, ...; ``--lora-dir`` files appear once named).
        quantization: the quantized components (`QuantizationInfo`), null when the weights are
            not quantized.
    """

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffserve"
    capabilities: list[str] | None = None
    parameters: dict[str, ParameterInfo] | None = None
    step_batching: bool | None = None
    extra_parameters: list[str] | None = None
    loras: list[dict[str, Any]] | None = None
    quantization: QuantizationInfo | None = None

    @classmethod
    def describe(cls, model_id: str, created: int, engine: "EngineClient | None") -> "ModelCard":
        """The card of the model `engine` serves: its adapter's capabilities and the request
        parameters with the model's defaults and the engine's limits. Without an engine (the
        model is loading) only ``id``, ``created`` and ``owned_by`` are set.

        Args:
            model_id: the served model name.
            created: Unix time in seconds.
            engine: the loaded engine, or None.
        """
        if engine is None:
            return cls(id=model_id, created=created)
        spec = engine.spec
        config = engine.config
        limits = config.limits
        max_n = min(limits.max_num_images_per_prompt, config.max_waiting_requests)
        tasks = model_tasks(spec)
        images = [t for t in ("text-to-image", "image-edit") if t in tasks]  # the Images API's; videos have theirs
        edit = ["image-edit"]
        video = ["text-to-video"]
        parameters = {
            "negative_prompt": ParameterInfo(type="string", description="text for the unconditional CFG branch"),
            "n": ParameterInfo(type="integer", default=1, minimum=1, maximum=max_n,
                               capabilities=images, description="images per request (image i uses seed + i)"),
            "size": ParameterInfo(type="string", default=f"{spec.default_width}x{spec.default_height}",
                                  multiple_of=spec.resolution_factor, max_width=spec.max_width,
                                  max_height=spec.max_height, max_pixels=limits.max_pixels,
                                  description='"WIDTHxHEIGHT" in pixels, or "auto"'),
            "num_inference_steps": ParameterInfo(type="integer", default=spec.default_num_inference_steps,
                                                 minimum=1, maximum=limits.max_num_inference_steps,
                                                 description="denoising steps"),
            "guidance_scale": ParameterInfo(type="number", default=spec.default_guidance_scale, minimum=0,
                                            maximum=MAX_GUIDANCE_SCALE,
                                            description="guidance weight as the model's diffusers pipeline "
                                                        "means it (CFG on when > 1; Flux-dev: embedded)"),
            "true_cfg_scale": ParameterInfo(type="number", default=spec.default_true_cfg_scale, minimum=0,
                                            maximum=MAX_GUIDANCE_SCALE,
                                            description="true CFG weight with a negative prompt (on when > 1)"),
            "strength": ParameterInfo(type="number", default=spec.default_strength, minimum=0, maximum=1,
                                      capabilities=edit,
                                      description="fraction of the schedule run on the noised input image"),
            "num_frames": ParameterInfo(type="integer", default=spec.default_num_frames, minimum=1,
                                        maximum=spec.max_num_frames or limits.max_num_frames, capabilities=video,
                                        description=f"frames (of the form {spec.frame_factor}k+1)"),
            "fps": ParameterInfo(type="integer", default=spec.default_fps, minimum=1, maximum=240,
                                 capabilities=video, description="frames per second of the video"),
            "seed": ParameterInfo(type="integer", minimum=0, maximum=MAX_SEED,
                                  description="seed of the first image (default: random, reported per image)"),
            "partial_images": ParameterInfo(type="integer", default=0, minimum=0, maximum=MAX_PARTIAL_IMAGES,
                                            capabilities=images,
                                            description="with stream=true: previews sent before each image"),
            "loras": ParameterInfo(type="object", minimum=-MAX_LORA_SCALE, maximum=MAX_LORA_SCALE,
                                   description=f"LoRA adapters, {{name: scale}}; at most {config.max_loras} per "
                                               "request (GET /v1/loras)"),
        }
        if spec.samplers:
            parameters["scheduler"] = ParameterInfo(type="string", enum=list(spec.samplers),
                                                    description="sampler (default: the model folder's scheduler)")
        if spec.max_clip_skip is not None:
            parameters["clip_skip"] = ParameterInfo(type="integer", minimum=1, maximum=spec.max_clip_skip,
                                                    capabilities=images,
                                                    description="CLIP layers skipped from the end (1 = pre-final)")
        if spec.samplers and "ddim" in spec.samplers and not spec.default_num_frames:
            parameters["eta"] = ParameterInfo(type="number", minimum=0, maximum=1, capabilities=images,
                                              description="DDIM eta (with scheduler ddim)")
        unused = {"guidance_scale": spec.default_guidance_scale, "true_cfg_scale": spec.default_true_cfg_scale,
                  "strength": spec.default_strength if spec.accepts_images else None,
                  "num_frames": spec.default_num_frames, "fps": spec.default_fps}
        for name, default in unused.items():  # a parameter the model does not take is not listed
            if default is None:
                parameters.pop(name)
        for name in [n for n, p in parameters.items() if p.capabilities == []]:  # none of its routes takes it
            parameters.pop(name)  # (``n``, ``partial_images`` on a video model: /v1/videos refuses them)
        extra = list(spec.extra_parameters) if spec.extra_parameters is not None else None
        return cls(id=model_id, created=created, capabilities=tasks, parameters=parameters,
                   step_batching=engine.model_info.step_batching, extra_parameters=extra,
                   loras=engine.list_loras(), quantization=QuantizationInfo.of(engine.model_info.quantization))


def model_tasks(spec) -> list[str]:
    """What a model does, from its spec: ``text-to-video`` (a video model), else
    ``text-to-image`` (unless every request needs an input image), plus ``image-edit`` when it
    takes input images."""
    if spec.default_num_frames is not None:
        return ["text-to-video"]
    return (["text-to-image"] if not spec.requires_images else []) + (["image-edit"] if spec.accepts_images else [])


class ModelList(BaseModel):
    """Response of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    """The ``error`` object of OpenAI's error format."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Body of every error response: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ErrorEvent(BaseModel):
    """SSE event ``error``: the stream failed (the error in OpenAI's format)."""

    type: Literal["error"] = "error"
    error: ErrorInfo


class QueuedEvent(BaseModel):
    """SSE event ``diffserve.queued`` (with ``stream_progress``): the 1-based place of image
    ``image_index`` in the engine's waiting queue, sent when queued and whenever it changes."""

    type: Literal["diffserve.queued"] = "diffserve.queued"
    image_index: int
    queue_position: int


class ProgressEvent(BaseModel):
    """SSE event ``diffserve.progress`` (with ``stream_progress``): denoising steps done of
    image ``image_index`` (step 0 when it leaves the queue)."""

    type: Literal["diffserve.progress"] = "diffserve.progress"
    image_index: int
    step: int
    num_inference_steps: int


#: The payloads of the image streams' events, added to the served schema's components.
SSE_PAYLOAD_MODELS: tuple[type[BaseModel], ...] = (PartialImageEvent, CompletedEvent, QueuedEvent, ProgressEvent,
                                                   ErrorEvent)


def scheduling_fields(body: Any) -> dict[str, Any]:
    """A generation body's ``priority`` (0 when unset) and ``deadline_s`` as `SamplingParams`
    keyword arguments (bodies without them: none)."""
    out: dict[str, Any] = {}
    if getattr(body, "priority", None) is not None:
        out["priority"] = body.priority
    if getattr(body, "deadline_s", None) is not None:
        out["deadline_s"] = body.deadline_s
    return out
