"""The step contract: `PipelineAdapter`, the base of every model family's step adapter (see
``pipelines/README.md``).

A step adapter wraps one family's diffusers pipeline and owns everything model-shaped, so the
engine, runner, acceleration backends and server never name a family. The runner drives it:

- plan: `check_params`, `rows` (images x guidance branches), `batch_key` (who may share a
  forward), `num_steps`, `step_key` (the part of the key that changes while a request runs);
- `prepare(state)`: encode the prompt (through the prompt-embedding cache), the request's own
  diffusion scheduler, timesteps and seeded latents;
- per step: `collate(states) -> StepBatch` (several requests' rows in ONE forward, branch-major,
  with their per-row data), `denoise(batch)` (the forward), `combine(batch, out)` (guidance)
  and `step(batch, guided)` (the diffusion scheduler, batched where it allows);
- `decode(state)`: VAE decode and post-processing.

A family implements four phases and declares the rest:

- `setup()`: what it builds from the loaded pipeline (text encoding, plug-ins, `capabilities`)
  and the `ModelSpec` limits its components fix;
- `prepare_request(state)`, `forward_inputs(batch)` (the denoiser's arguments), `decode`;
- declarations: `pipeline_class`, `sampling_defaults` (the diffusers ``__call__`` defaults;
  a folder's ``generation_config.json`` overrides them), `batch_key_fields`, `image_input`,
  `text_inputs`, `padded_inputs`, `appended_latents`, and the strategies `guidance` (CFG, true
  CFG with norm rescale, embedded guidance: `guidance.Guidance`), `stepping` (batched
  flow-matching Euler or each request's scheduler: `diffusion_scheduler.Stepping`) and
  `expert_routing` (Wan 2.2's two experts: `experts.ExpertRouting`);
- per-request samplers (`per_request_samplers`, `samplers.SamplerTemplates`): a family builds
  each request's scheduler with `request_scheduler` and states the ``set_timesteps`` arguments
  it passes (`timestep_arguments`); CLIP families state `max_clip_skip` and encode the prompt
  with `clip_skip_inputs`.

A whole request is prepare, then collate + denoise + combine + step until done, then decode:
the request path and the step path share one implementation.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from diffserve.core.errors import InvalidRequestError, NonFiniteOutputError
from diffserve.core.inputs import RequestInputs
from diffserve.core.sampling_params import ModelSpec, SamplingParams
from diffserve.pipelines import diffusion_scheduler, samplers
from diffserve.pipelines.capabilities import AdapterOptions, CacheDiTSupport, Capabilities, TeaCacheSupport
from diffserve.pipelines.diffusion_scheduler import FLOW_MATCH_EULER, Stepping
from diffserve.models.model_index import read_cache_calibration
from diffserve.pipelines.generation_config import model_spec, read_generation_config
from diffserve.pipelines.guidance import CFG, Guidance, uniform_or_rows
from diffserve.pipelines.request_state import RequestState
from diffserve.pipelines.row_data import NO_ROW_DATA, current_rows, forward_rows
from diffserve.pipelines.step_batch import BatchCache, StepBatch, collate_branches
from diffserve.pipelines.text_encoding import repeat_rows
from diffserve.pipelines.token_spans import latent_rows, zero_padded_tokens

if TYPE_CHECKING:
    from diffserve.pipelines.experts import ExpertRouting
    from diffserve.pipelines.text_encoding import PromptCache, TextEncoder

#: Batch compositions whose `BatchCache` an adapter keeps (several interleave when a cache
#: backend runs requests one per forward, or batch keys alternate).
_BATCH_CACHES = 8

#: ``call(batch, kwargs) -> output``: runs the denoiser module on prepared keyword inputs. Cache
#: backends pass their own to `PipelineAdapter.denoise` (TeaCache splits the forward there).
DenoiserCall = Callable[[StepBatch, dict[str, Any]], torch.Tensor]


class PipelineAdapter(ABC):
    """Base class of the model families' step adapters (one per diffusers pipeline class).

    Subclasses declare the class attributes below and implement `setup`, `prepare_request`,
    `decode` and, unless the batch's inputs are the denoiser's arguments as they are,
    `forward_inputs`. The constructor (called by `from_components`) stores the pipeline, reads
    the folder's ``generation_config.json``, runs `setup` and builds `spec`.

    Attributes:
        pipe: the family's diffusers pipeline on the loaded components.
        device / dtype: where and in which dtype the model computes.
        spec: the `ModelSpec` (defaults and limits).
        generation_config: the folder's ``generation_config.json`` ({} without one).
    """

    # ------------------------------------------------------------ declarations
    #: ``_class_name`` of the folders this adapter serves (``model_index.json``).
    pipeline_class_name: ClassVar[str]
    #: The diffusers pipeline class built from the loaded components.
    pipeline_class: ClassVar[type]
    #: Components a folder may leave out (built as None), besides the pipeline class's own
    #: ``_optional_components``.
    optional_components: ClassVar[tuple[str, ...]] = ()
    #: The pipeline attribute holding the denoiser (``"transformer"``, ``"unet"``).
    denoiser_name: ClassVar[str] = "transformer"
    #: The family's diffusers ``__call__`` defaults by sampling field (``num_inference_steps``,
    #: ``guidance_scale``, ``true_cfg_scale``, ``max_sequence_length``, ``strength``,
    #: ``num_frames``, ``fps``, ``height`` / ``width``: default `default_size`); the folder's
    #: ``generation_config.json`` overrides each. A field not listed (or a guidance field the
    #: `guidance` does not use) is not used by the model: a request setting it is refused.
    sampling_defaults: ClassVar[dict[str, Any]] = {}
    #: Sampling fields that requests sharing a forward must agree on besides size, frames and
    #: branches (e.g. ``max_sequence_length`` where it fixes the text length).
    batch_key_fields: ClassVar[tuple[str, ...]] = ()
    #: Whether requests of different sizes (and, for video, frame counts) share a forward
    #: (`token_spans`): the batch key then holds no height, width and frame count; each
    #: request sets its token span as row data and the
    #: family's forward gives each row its own positions and attention span. UNet families
    #: keep batching by size (README, "Mixed sizes"). `setup` may turn it off for a folder.
    mixed_sizes: bool = False
    #: Whether an eager mixed-size forward runs its repeated blocks once per row size on real
    #: tokens only (`diffserve.pipelines.length_groups`) instead of once over the padded rows
    #: with masks; cleared by ``EngineConfig.length_groups = False``. Every family that mixes
    #: sizes installs a grouped block forward gated by `grouping` (SD3, Flux, Flux Kontext,
    #: Qwen-Image, Qwen-Image-Edit, Wan): a new mixed family must too, since the request
    #: scheduler then treats padding as compute-free (`ModelInfo.padding_free`).
    length_groups: bool = True
    #: Input images: ``"none"`` (text-to-X), ``"optional"`` (image-to-image) or ``"required"``
    #: (edits); at most one image, never a mask.
    image_input: ClassVar[str] = "none"
    #: The denoiser inputs `text.encode` returns, in order (see `text_branch`).
    text_inputs: ClassVar[tuple[str, ...]] = ("encoder_hidden_states",)
    #: A per-branch input of reference latents whose tokens follow the noisy latents' along the
    #: sequence (edits: Kontext, Qwen-Image-Edit): collation right-pads them with zeros to the
    #: batch's longest reference (`mixed_sizes`), appends them to ``hidden_states`` and the
    #: forward's prediction for them is dropped. None: no reference.
    appended_latents: ClassVar[str | None] = None
    #: Components of the model's AR stage (e.g. ``("language_model", "tokenizer")``): a folder
    #: whose pipeline class lists some has an autoregressive stage before the DiT stage. The
    #: AR stage is built from them by `build_ar_stage` and runs in its own runner
    #: (`diffserve.runner.ar_stage`); the adapter is built without them. Empty: one stage.
    ar_stage_components: ClassVar[tuple[str, ...]] = ()
    #: Whether requests may stream video chunks (``num_chunks``, `video_chunks`): the adapter
    #: implements `start_chunk`.
    chunk_streaming: ClassVar[bool] = False
    #: Decoded frames a chunk after the first repeats from the end of the previous chunk (its
    #: conditioning frames); they are not emitted again.
    chunk_overlap_frames: ClassVar[int] = 0

    #: Whether requests may pick a sampler (``SamplingParams.scheduler``): the family builds
    #: every request's scheduler with `request_scheduler` and states its `timestep_arguments`;
    #: the samplers offered are those valid for the folder's scheduler (`samplers`).
    per_request_samplers: ClassVar[bool] = False

    #: Strategies (class defaults; `setup` may choose per folder).
    guidance: Guidance = CFG
    stepping: Stepping = FLOW_MATCH_EULER
    expert_routing: "ExpertRouting | None" = None
    #: Per-branch inputs of variable length: ``{key: (mask_key or None, pad_value)}``; they are
    #: right-padded along dim 1 to the batch's longest and ``mask_key`` (rows, L) bool marks the
    #: real tokens (None when no row is padded). Replace it, never mutate it.
    padded_inputs: dict[str, tuple[str | None, float]] = {}
    #: What acceleration the family supports and how (set by `setup`).
    capabilities: Capabilities = Capabilities()
    #: The family's text encoding through the prompt cache (set by `setup`).
    text: "TextEncoder | None" = None
    #: LRU of prompt encodings installed by the model runner (None = off;
    #: `diffserve.acceleration.prompt_embed_cache.PromptEmbedCache`).
    prompt_embed_cache: "PromptCache | None" = None

    device: torch.device
    dtype: torch.dtype
    spec: ModelSpec

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, options: AdapterOptions):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.options = options
        self.generation_config = read_generation_config(options.model_dir)
        limits = dict(self.setup())
        limits.setdefault("samplers", self.samplers.available() if self.samplers is not None else None)
        limits.setdefault("max_clip_skip", self.max_clip_skip())
        limits.setdefault("accepts_images", self.image_input != "none")
        limits.setdefault("requires_images", self.image_input == "required")
        self.spec = model_spec(self.pipeline_class_name, self._sampling_defaults(), self.generation_config, limits)
        # the folder's calibration (diffserve calibrate-cache) over its generation_config.json entry
        preset = {**self.generation_config.get("teacache", {}),
                  **read_cache_calibration(options.model_dir).get("teacache", {})}
        if preset and self.capabilities.teacache is not None:
            self.capabilities = replace(self.capabilities, teacache=self.capabilities.teacache.with_preset(preset))

    def grouping(self) -> bool:
        """Whether eager mixed-size forwards run per length group now (`length_groups` and
        `mixed_sizes`: Ulysses or ``--no-mixed-sizes`` batch by size); read by the families'
        grouped block forwards at every forward."""
        return self.mixed_sizes and self.length_groups

    def _sampling_defaults(self) -> dict[str, Any]:
        """`sampling_defaults` with the default size, less the guidance fields the strategies
        do not use; the second expert's CFG weight defaults to the (folder's) first one."""
        defaults = dict(self.sampling_defaults)
        if "height" not in defaults:
            defaults["height"], defaults["width"] = self.default_size()
        used = set(self.guidance.fields) | set(self.expert_routing.fields if self.expert_routing else ())
        for name in ("guidance_scale", "true_cfg_scale", "guidance_scale_2"):
            if name not in used:
                defaults.pop(name, None)
        if self.expert_routing is not None:
            defaults.setdefault("guidance_scale_2", self.generation_config.get("guidance_scale",
                                                                               defaults["guidance_scale"]))
        return defaults

    # ------------------------------------------------------------------ loading
    @classmethod
    def component_loaders(cls) -> dict[str, Callable[[Path], Any]]:
        """Components this family loads itself, by their ``model_index.json`` name:
        ``loader(folder) -> component`` replaces the library's ``from_pretrained`` (e.g. a
        processor whose library class needs an optional dependency). Default: none."""
        return {}

    @classmethod
    def from_components(cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype,
                        options: AdapterOptions) -> "PipelineAdapter":
        """Build `pipeline_class` from the loaded components (missing optional ones as None)
        and the folder's pipeline settings it accepts (`pipeline_settings`), move it to
        `device` and wrap it."""
        components = {**components}
        for name in (*getattr(cls.pipeline_class, "_optional_components", ()), *cls.optional_components):
            components.setdefault(name, None)
        pipe = cls.pipeline_class(**components, **cls.pipeline_settings(components, options))
        pipe.to(device, silence_dtype_warnings=True)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, dtype, options)

    @classmethod
    def pipeline_settings(cls, components: dict[str, Any], options: AdapterOptions) -> dict[str, Any]:
        """The folder's ``model_index.json`` settings that `pipeline_class` accepts (e.g. Wan
        2.2's ``boundary_ratio``), as diffusers' ``from_pretrained`` passes them."""
        from diffserve.models.model_index import pipeline_config

        accepted = inspect.signature(cls.pipeline_class.__init__).parameters
        return {k: v for k, v in pipeline_config(options.model_dir).items() if k in accepted}

    @abstractmethod
    def setup(self) -> dict[str, Any]:
        """Build what the family needs from ``self.pipe`` (`text`, `capabilities`, plug-ins,
        per-folder strategies) and return the `ModelSpec` fields its components fix
        (``resolution_factor``; optionally ``max_height`` / ``max_width``,
        ``max_sequence_length_limit``, ``max_prompt_tokens``, ``frame_factor``, ...).

        Raises:
            UnsupportedModelError: the folder is a variant the family cannot serve.
        """

    def default_size(self) -> tuple[int, int]:
        """(height, width) in pixels when a request gives none: the pipeline's
        ``default_sample_size`` x its VAE scale factor, as diffusers' ``__call__``."""
        side = self.pipe.default_sample_size * self.pipe.vae_scale_factor
        return side, side

    @classmethod
    def build_ar_stage(cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
        """The model's AR stage (`diffserve.pipelines.ar_stage.ARStageModel`) from the loaded
        `ar_stage_components` (moved to `device` here).

        Raises:
            NotImplementedError: a single-stage family.
        """
        raise NotImplementedError(f"{cls.pipeline_class_name} has no AR stage")

    def context_branches(self, params: SamplingParams) -> tuple[str, ...]:
        """The AR-stage payload branches a request needs (e.g. ``("negative", "cond")`` with
        CFG); a request whose payloads lack one fails. Default: none (single stage)."""
        return ()

    @property
    def denoiser(self) -> torch.nn.Module:
        """The transformer/UNet called once per step (what caches and compile wrap); with expert
        routing both experts (``nn.ModuleList``)."""
        if self.expert_routing is not None:
            return self.expert_routing.module
        return getattr(self.pipe, self.denoiser_name)

    @property
    def vae(self) -> torch.nn.Module | None:
        """The VAE (decoded by `decode`; compiled with ``compile_vae``), or None."""
        return getattr(getattr(self, "pipe", None), "vae", None)

    def modules(self) -> dict[str, torch.nn.Module]:
        """Every torch module of the pipeline by component name (for offload and sleep)."""
        pipe = getattr(self, "pipe", None)
        if pipe is None:
            return {"denoiser": self.denoiser}
        return {name: m for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}

    # ------------------------------------------------------------------ samplers
    @property
    def samplers(self) -> samplers.SamplerTemplates | None:
        """The model's per-request samplers, templates built from the folder's scheduler (once);
        None when the family does not offer them (`per_request_samplers`) or has no
        scheduler."""
        if "_samplers" not in self.__dict__:
            base = getattr(getattr(self, "pipe", None), "scheduler", None)
            self._samplers = (samplers.SamplerTemplates(base, self.timestep_arguments)
                              if self.per_request_samplers and base is not None else None)
        return self._samplers

    def timestep_arguments(self, scheduler: Any, num_steps: int) -> dict[str, Any]:
        """Example ``set_timesteps`` arguments the family passes to `scheduler` for
        `num_steps` steps besides the step count and device (e.g. ``{"sigmas": ..., "mu":
        ...}``, values as diffusers' ``__call__`` computes them up to the image size): a sampler
        whose scheduler cannot set a schedule from them is not offered
        (`samplers.SamplerTemplates.available`). Default: none."""
        return {}

    def max_clip_skip(self) -> int | None:
        """Largest ``clip_skip`` the family's CLIP text encoders take (None: its encoding does
        not take ``clip_skip``). Default: None."""
        return None

    @staticmethod
    def clip_layers_skippable(*encoders: Any) -> int | None:
        """Largest ``clip_skip`` over CLIP text `encoders` (their hidden layers - 1, the
        smallest; diffusers reads ``hidden_states[-(clip_skip + 2)]`` in SDXL / SD3); None
        without any."""
        layers = [e.config.num_hidden_layers for e in encoders if e is not None]
        return min(layers) - 1 if layers and min(layers) > 1 else None

    @staticmethod
    def clip_skip_inputs(params: SamplingParams) -> dict[str, Any]:
        """`TextEncoder.encode` keyword arguments for the request's ``clip_skip`` ({} without
        one): the family's encoding takes ``clip_skip``, the prompt cache keys it apart. For the
        prompt only: diffusers' ``encode_prompt`` encodes the negative prompt without it."""
        if params.clip_skip is None:
            return {}
        return {"extra_key": ("clip_skip", params.clip_skip), "clip_skip": params.clip_skip}

    def request_scheduler(self, params: SamplingParams) -> Any:
        """A fresh diffusion scheduler for one request (`diffusion_scheduler.new_scheduler`):
        of its ``scheduler`` sampler, or the folder's own when it names none."""
        template = self.pipe.scheduler
        if params.scheduler is not None and self.samplers is not None:
            template = self.samplers.template(params.scheduler)
        return diffusion_scheduler.new_scheduler(template)

    # --------------------------------------------------------------- per request
    def check_params(self, params: SamplingParams, inputs: RequestInputs | None) -> None:
        """Checks on resolved params: the input images `image_input` allows, no mask, and no
        1-step schedule on schedulers that stretch their sigmas to a terminal value
        (``shift_terminal``: 0/0 = NaN in diffusers). Families add their own.

        Raises:
            InvalidRequestError: naming the field.
        """
        images = inputs.images if inputs is not None else []
        if self.image_input == "none" and (images or (inputs is not None and inputs.mask is not None)):
            raise InvalidRequestError("image", "<image>", f"absent: {self.pipeline_class_name} "
                                      "is a text-to-image model without image inputs")
        if inputs is not None and inputs.mask is not None:
            raise InvalidRequestError("mask", "<mask>", f"absent: {self.pipeline_class_name} does not inpaint "
                                      "(it takes no mask)")
        if self.image_input == "required" and not images:
            raise InvalidRequestError("image", None, f"one input image: {self.pipeline_class_name} edits an image")
        if len(images) > 1:
            raise InvalidRequestError("image", f"{len(images)} images", f"exactly one input image for "
                                      f"{self.pipeline_class_name}")
        scheduler = getattr(getattr(self, "pipe", None), "scheduler", None)
        if params.scheduler is not None and self.samplers is not None:
            scheduler = self.samplers.template(params.scheduler)
            allowed = self.spec.image_samplers
            if images and allowed is not None and params.scheduler not in allowed:
                raise InvalidRequestError("scheduler", params.scheduler, f"one of {', '.join(allowed)} or null with an "
                                          f"input image ({self.pipeline_class_name} takes only these then)")
        if params.num_inference_steps == 1 and scheduler is not None and scheduler.config.get("shift_terminal"):
            raise InvalidRequestError("num_inference_steps", 1,
                                      "at least 2 for this model (its scheduler's shift_terminal turns a "
                                      "1-step schedule into NaN in diffusers)")
        if params.eta is not None and (scheduler is None or not self.stepping.takes_eta(scheduler)):
            raise InvalidRequestError("eta", params.eta, "unset: eta applies to DDIM-type schedulers (scheduler "
                                      f"\"ddim\") in families that pass it, and this request's is "
                                      f"{type(scheduler).__name__} in {self.pipeline_class_name}")

    def branches(self, params: SamplingParams) -> int:
        """Guidance branches of a request (`guidance`): 2 with (true) CFG, else 1."""
        return self.guidance.branches(params)

    def rows(self, params: SamplingParams) -> int:
        """Denoiser rows a request adds to a step batch: images x branches."""
        return params.num_images_per_prompt * self.branches(params)

    def num_steps(self, params: SamplingParams, inputs: RequestInputs | None = None) -> int:
        """Denoising steps the request will run (what its progress events count and preview
        steps refer to): ``num_inference_steps``; image-to-image families that run only part
        of the schedule override it."""
        return params.num_inference_steps

    def batch_key(self, params: SamplingParams, inputs: RequestInputs | None = None) -> Hashable:
        """Requests with equal keys may share one denoise forward: (family, branches, size,
        frames, dtype, the `batch_key_fields`, the input image's encoded size (`image_size`));
        with `mixed_sizes` neither size nor the frame count is part of it (rows of different
        output and reference sizes, and frame counts, share a forward as data, `token_spans`)."""
        mixed = self.mixed_sizes
        image = self.image_size(inputs.images[0]) if not mixed and inputs is not None and inputs.images else None
        size, frames = (None, None) if mixed else ((params.height, params.width), params.num_frames)
        return (self.pipeline_class_name, self.branches(params), size, frames,
                self.dtype, tuple(getattr(params, f) for f in self.batch_key_fields), image)

    def image_size(self, image: Any) -> tuple[int, int] | None:
        """(height, width) in pixels an input image is encoded at when that size sets the
        forward's sequence (edits' reference tokens); None when it does not (image-to-image
        resizes it to the output)."""
        return None

    def step_key(self, state: RequestState) -> Hashable:
        """The part of the batch key that may change while a request runs (plain, picklable
        data): requests whose next steps have different step keys never share a forward (the
        expert of `expert_routing`). The runner reports it after `prepare` and after every step
        when `step_keys_vary`. None: constant."""
        return None if self.expert_routing is None else self.expert_routing.step_key(state)

    @property
    def step_keys_vary(self) -> bool:
        """Whether `step_key` can change while a request runs."""
        return self.expert_routing is not None

    def texts_to_encode(self, prompt: str, params: SamplingParams) -> list[tuple[str, int | None]]:
        """The (text, max_sequence_length) pairs `prepare` encodes for a request: the prompt
        and, with two guidance branches, the negative prompt ("" when unset). The runner encodes
        those of the requests it prepares together in one batched call
        (`TextEncoder.encoding_together`); a family that encodes other texts overrides it (a
        wrong list only costs time: each text is still encoded on its own when needed)."""
        texts = [(prompt, params.max_sequence_length)]
        if self.branches(params) == 2:
            texts.append((params.negative_prompt or "", params.max_sequence_length))
        return texts

    def prompt_is_truncated(self, prompt: str, max_sequence_length: int | None = None) -> bool:
        """Whether `prompt` exceeds a text encoder's token limit (it will be truncated)."""
        return self.text.is_truncated(prompt, max_sequence_length) if self.text is not None else False

    def prepare(self, state: RequestState) -> None:
        """Note prompt truncation, seed the request's generator, set its guidance weight, then
        `prepare_request`: encode the prompt(s), draw its latents and create its own diffusion
        scheduler with timesteps."""
        p = state.params
        state.prompt_truncated = self.prompt_is_truncated(state.prompt, p.max_sequence_length)
        if p.negative_prompt and self.branches(p) > 1:
            state.negative_prompt_truncated = self.prompt_is_truncated(p.negative_prompt, p.max_sequence_length)
        state.generator = request_generator(p)
        state.step_index = 0
        state.guidance_scale = self.guidance.weight(p)
        self.prepare_request(state)

    @abstractmethod
    def prepare_request(self, state: RequestState) -> None:
        """Fill `state`: ``branches`` (per-branch denoiser inputs, e.g. `text_branches`),
        ``shared`` inputs, ``row_data``, ``latents`` (from ``state.generator``) and the schedule
        (`set_schedule`)."""

    def _branch_texts(self, state: RequestState) -> list[str]:
        """The texts of the request's guidance branches, negative first (``negative_prompt or
        ""``)."""
        p = state.params
        return [p.negative_prompt or "", state.prompt] if self.branches(p) == 2 else [state.prompt]

    def text_branch(self, state: RequestState, text: str, **encode: Any) -> dict[str, Any]:
        """One branch's inputs for `text`: its encoding (`text.encode` with the request's
        ``max_sequence_length`` and `encode`'s keyword arguments) under `text_inputs`, repeated
        for the request's images, plus the guidance's own inputs (embedded guidance). Also what
        the runner asks for an interaction's new prompt in a stream (the conditional branch,
        ``state.branches[-1]`` layout)."""
        p = state.params
        encoded = self.text.encode(text, p.max_sequence_length, **encode)
        branch = {name: repeat_rows(t, p.num_images_per_prompt) for name, t in zip(self.text_inputs, encoded)}
        branch.update(self.guidance.branch_inputs(p, p.num_images_per_prompt, self.device))
        return branch

    def text_branches(self, state: RequestState, **encode: Any) -> list[dict[str, Any]]:
        """`text_branch` of each guidance branch's text, negative first (``negative_prompt or
        ""``); the prompt's with the request's `clip_skip_inputs`."""
        texts = self._branch_texts(state)
        clip = self.clip_skip_inputs(state.params)
        branches = [self.text_branch(state, text, **encode) for text in texts[:-1]]
        if clip:
            key = (encode.get("extra_key", ()), clip["extra_key"])
            encode = {**encode, **clip, "extra_key": key}
        return branches + [self.text_branch(state, texts[-1], **encode)]

    def set_schedule(self, state: RequestState, scheduler: Any, timesteps: torch.Tensor, begin: int = 0) -> None:
        """Give the request `scheduler` (its own, `request_scheduler`, after ``set_timesteps``)
        and the `timesteps` it runs (from index `begin` of the scheduler's schedule): its sigmas
        for the batched step and its step arguments (`stepping`), step 0, and its expert switch
        (`expert_routing`)."""
        state.scheduler = scheduler
        state.timesteps = timesteps
        state.sigmas = self.stepping.sigmas(scheduler, len(timesteps), begin)
        state.step_kwargs = self.stepping.step_kwargs(scheduler, state.generator, state.params.eta)
        state.step_index = 0
        if self.expert_routing is not None:
            self.expert_routing.start(state)

    # ------------------------------------------------------------------ per step
    def collate(self, states: list[RequestState]) -> StepBatch:
        """Gather the requests' rows into one forward, branch-major: rows ``b * N + i`` hold
        branch ``b`` of latent row ``i`` (N = total images). ``batch.inputs`` holds the
        per-branch inputs concatenated (padded where `padded_inputs` says), ``hidden_states``
        (rows, ...) (the `appended_latents`, right-padded to the longest, after the latents'
        tokens) and ``timestep``
        (rows,), plus the shared inputs of the first request; ``batch.row_data`` the requests'
        per-row data. A batch of the same requests as the previous step reuses all of it but
        latents and timesteps (`step_batch.BatchCache`)."""
        caches = self.__dict__.setdefault("_batch_caches", OrderedDict())
        key = tuple(id(s) for s in states)  # safe: a cache holds its states alive
        if key not in caches:  # a new composition: drop caches of batches a request of which finished
            for old in [k for k, c in caches.items() if any(s.latents is None for s in c.states)]:
                del caches[old]
        cache = caches.pop(key, None) or BatchCache()
        caches[key] = cache
        while len(caches) > _BATCH_CACHES:
            caches.popitem(last=False)
        model_input = _scaled_model_input if self.stepping.scaled_input else None
        padded = self.padded_inputs
        if self.appended_latents is not None:  # references of different sizes (mixed): zero tokens after each
            padded = {**padded, self.appended_latents: (None, 0.0)}
        batch = collate_branches(states, model_input, padded, cache)
        if self.appended_latents is not None and self.appended_latents in batch.inputs:
            reference = batch.inputs.pop(self.appended_latents)
            batch.inputs["hidden_states"] = torch.cat([batch.inputs["hidden_states"], reference], dim=1)
        return batch

    def denoise(self, batch: StepBatch, call: DenoiserCall | None = None) -> torch.Tensor:
        """One denoiser forward with the batch's row data as the forward context
        (`row_data.forward_rows`); returns the raw prediction for every row (rows, ...) in the
        latent layout (reference tokens dropped). `call` replaces the plain module call (cache
        backends, CUDA graphs)."""
        kwargs = self.forward_inputs(batch)
        if self.expert_routing is not None:
            kwargs = {**kwargs, "expert": self.expert_routing.batch_expert(batch.states)}
        if batch.row_data is NO_ROW_DATA and current_rows() is NO_ROW_DATA:  # nothing per row: no context to set
            out = (call or self.call_denoiser)(batch, kwargs)
        else:
            with forward_rows(batch.row_data):
                out = (call or self.call_denoiser)(batch, kwargs)
        if self.appended_latents is not None:
            out = out[:, : batch.latents.shape[1]]
        return out

    def forward_inputs(self, batch: StepBatch) -> dict[str, Any]:
        """Keyword arguments of the denoiser module for this batch (default: the batch's
        inputs as collated)."""
        return batch.inputs

    def call_denoiser(self, batch: StepBatch, kwargs: dict[str, Any]) -> torch.Tensor:
        """The plain denoiser call (``module(**kwargs, return_dict=False)[0]``); with expert
        routing the module is expert ``kwargs["expert"]``."""
        if "expert" in kwargs:
            kwargs = dict(kwargs)
            return self.expert_routing.experts[kwargs.pop("expert")](**kwargs, return_dict=False)[0]
        return self.denoiser(**kwargs, return_dict=False)[0]

    def combine(self, batch: StepBatch, out: torch.Tensor) -> torch.Tensor:
        """Guided prediction (N, ...) from the (branches * N, ...) output (`guidance`), with each
        request's weight (its expert's with `expert_routing`): CFG ``uncond + w * (cond -
        uncond)`` (Ho & Salimans 2022), norm-rescaled where declared. Packed token latents
        (N, L, C) of different sizes: zero on each request's padded tokens (after guidance: a
        norm-rescaled CFG of zero vectors is 0/0), so padded latents stay zero."""
        if batch.branches == 1:
            guided = out
        else:
            uncond, cond = out.chunk(2)
            weights = ([s.guidance_scale for s in batch.states] if self.expert_routing is None
                       else self.expert_routing.guidance_weights(batch.states))
            guided = self.guidance.combine(uncond, cond, uniform_or_rows(weights, batch.row_values))
        if batch.latent_sizes is None or guided.dim() != 3:
            return guided
        return zero_padded_tokens(guided, guided.shape[1], latent_rows(batch.row_data, batch.num_latent_rows))

    def step(self, batch: StepBatch, guided: torch.Tensor) -> dict[str, BaseException]:
        """One diffusion-scheduler step for every request of `batch` (batched where the
        scheduler allows, see `diffusion_scheduler.step_batch`); a stream chunk's conditioning
        frames are then put back at the next step's noise level (`video_chunks.ChunkCondition`).
        Returns per-request failures (the others stepped)."""
        failures = diffusion_scheduler.step_batch(batch, guided)
        if self.chunk_streaming:
            for state in batch.states:
                if state.chunk_condition is not None and state.request_id not in failures:
                    state.latents = state.chunk_condition.apply(state.latents, state.step_index)
        return failures

    # ------------------------------------------------------------ video streams
    def start_chunk(self, state: RequestState, previous: Any) -> None:
        """Set `state` up for the next chunk of a stream, conditioned on the previous chunk:
        fresh latents from ``state.generator``, a fresh schedule (`set_schedule`) and
        ``state.chunk_condition``; the prompt inputs (``branches``) are the caller's.

        Args:
            previous: the previous chunk's decoded frames, uint8 numpy (F, H, W, 3).

        Raises:
            NotImplementedError: the family cannot stream chunks (`chunk_streaming` False).
        """
        raise NotImplementedError(f"{self.pipeline_class_name} cannot stream video chunks")

    # ------------------------------------------------------------------ decode
    @abstractmethod
    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Decode `latents` (default: the state's) into media of ``params.output_type``
        (`checked_pixels` before PIL / uint8); video models return one entry per video."""

    def decode_many(self, states: list[RequestState], latents: list[torch.Tensor]) -> list[Any]:
        """Decode several requests (each its own latents); one result or exception per request.
        Default: one `decode` each; families override to run one VAE forward for all."""
        results: list[Any] = []
        for state, x in zip(states, latents):
            try:
                results.append(self.decode(state, x))
            except Exception as exc:  # noqa: BLE001 - each request's failure stays its own
                results.append(exc)
        return results


def _scaled_model_input(state: RequestState) -> torch.Tensor:
    """``scheduler.scale_model_input(latents, t)`` with the request's own scheduler (identity for
    PNDM / DDIM / DPM-Solver, ``x / sqrt(sigma^2 + 1)`` for Euler types)."""
    return state.scheduler.scale_model_input(state.latents, state.timestep)


def checked_pixels(image: torch.Tensor) -> torch.Tensor:
    """`image` (decoded VAE output) unchanged if finite.

    Raises:
        NonFiniteOutputError: it holds NaN/inf (post-processing to PIL would hide it as black).
    """
    if not is_finite(image):
        raise NonFiniteOutputError("the VAE decode produced non-finite pixels (NaN/inf; e.g. fp16 overflow: "
                                   "try --dtype bf16 or fp32)")
    return image


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite (one reduction + one host sync)."""
    return bool(torch.isfinite(tensor).all()) if tensor.is_floating_point() else True


__all__ = ["AdapterOptions", "Capabilities", "CacheDiTSupport", "DenoiserCall", "PipelineAdapter",
           "RequestInputs", "RequestState", "StepBatch", "TeaCacheSupport", "checked_pixels", "is_finite"]


def request_generator(params: SamplingParams) -> torch.Generator | list[torch.Generator]:
    """The CPU generator(s) a request draws its noise from: one seeded with ``params.seed`` for
    one image; for several, one per image seeded with `SamplingParams.image_seeds`, which
    diffusers' ``prepare_latents`` / ``randn_tensor`` and schedulers' ``step`` take as a list
    (row i drawn from generator i)."""
    seeds = params.image_seeds()
    generators = [torch.Generator(device="cpu").manual_seed(seed) for seed in seeds]
    return generators[0] if len(generators) == 1 else generators
