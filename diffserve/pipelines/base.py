"""The step contract every pipeline adapter implements (see ``pipelines/README.md``).

An adapter wraps one model family's diffusers components. It owns everything model-shaped, so
the engine, runner, acceleration backends and server never name a family:

- how many denoiser rows a request takes (`PipelineAdapter.branches` x images per prompt),
  which requests may share a forward (`batch_key`), and family-specific field checks
  (`check_params`);
- `prepare(state)`: encode the prompt (through the prompt-embedding cache), create the
  request's own diffusion-scheduler instance, its timesteps/sigmas and initial latents from its
  own seeded generator;
- `collate(states) -> StepBatch`: several requests' inputs become ONE denoiser forward
  (per-row tensors, batch-shared tensors, padding + masks, nested dicts);
- `denoise(batch)`: that forward; `combine(batch, out)`: CFG / true CFG over the branches;
  `step(batch, guided)`: one diffusion-scheduler step for every request of the batch;
- `decode(state)`: VAE decode and post-processing;
- `capabilities`: how cache backends and regional compile hook into its denoiser.

A whole request is prepare, then collate+denoise+combine+step until done, then decode: the
request path and the step path share one implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from diffserve.core.errors import InvalidRequestError, NonFiniteOutputError
from diffserve.core.inputs import RequestInputs
from diffserve.pipelines import diffusion_scheduler, guidance
from diffserve.pipelines.step_batch import BatchCache, StepBatch, collate_branches
from diffserve.core.sampling_params import ModelSpec, SamplingParams

if TYPE_CHECKING:
    from diffserve.pipelines.text_encoding import PromptCache, TextEncoder

#: Batch compositions whose `BatchCache` an adapter keeps (several interleave when a cache
#: backend runs requests one per forward, or batch keys alternate).
_BATCH_CACHES = 8

#: ``call(batch, kwargs) -> output``: runs the denoiser module on prepared keyword inputs. Cache
#: backends pass their own to `PipelineAdapter.denoise` (TeaCache splits the forward there).
DenoiserCall = Callable[[StepBatch, dict[str, Any]], torch.Tensor]


@dataclass
class RequestState:
    """Per-request tensors and diffusion-scheduler state, owned by the model runner.

    Attributes:
        params: resolved `SamplingParams` (no None fields that the model uses).
        inputs: input images / mask, or None for text-to-image.
        generator: CPU `torch.Generator` seeded with ``params.seed``.
        latents: (num_images, ...) in the family's latent layout (e.g. (N, C, h, w) for SD3,
            packed (N, h*w/4, 4C) for Flux), in the model dtype.
        branches: per guidance branch (unconditional/negative first, conditional last), the
            denoiser inputs of that branch with leading dim num_images (or nested dicts of such).
        shared: denoiser inputs equal for every request of one batch key (e.g. Flux's 2-D
            position ids); taken from the first request of a batch.
        guidance_scale: weight of the branch combine (CFG / true CFG), 1.0 without.
        scheduler: this request's own diffusion-scheduler instance.
        step_kwargs: extra keyword arguments of its ``scheduler.step`` (eta, generator).
        timesteps: (num_steps,) float tensor, the denoiser's timestep at each step.
        sigmas: (num_steps + 1,) float32 noise levels for the batched flow-matching Euler step
            (None = the scheduler's own `step` is used, per request).
        step_index: denoising steps done.
        extra: room for acceleration backends' per-request state.
        chunk_condition: streams: the adapter's conditioning of the current chunk on the
            previous one (e.g. `video_chunks.ChunkCondition`), None for the first chunk and
            for ordinary requests.
        context: multi-stage models: the payloads an earlier stage (the AR stage) produced for
            this request, by guidance branch (`diffserve.connector.payload.Payload`), received
            by the runner before `PipelineAdapter.prepare`; None for single-stage models.
    """

    request_id: str
    prompt: str
    params: SamplingParams
    inputs: RequestInputs | None = None
    generator: torch.Generator | None = None
    latents: torch.Tensor | None = None
    branches: list[dict[str, Any]] = field(default_factory=list)
    shared: dict[str, Any] = field(default_factory=dict)
    guidance_scale: float = 1.0
    scheduler: Any = None
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    timesteps: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None
    step_index: int = 0
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    chunk_condition: Any = None
    context: dict[str, Any] | None = None

    @property
    def num_steps(self) -> int:
        return 0 if self.timesteps is None else len(self.timesteps)

    @property
    def done(self) -> bool:
        """All denoising steps have run."""
        return self.timesteps is not None and self.step_index >= len(self.timesteps)

    @property
    def num_images(self) -> int:
        return self.params.num_images_per_prompt

    @property
    def timestep(self) -> torch.Tensor:
        """The current step's timestep (0-dim)."""
        return self.timesteps[self.step_index]

    def release(self) -> None:
        """Drop every tensor this request holds (abort / failure / finish)."""
        self.latents = None
        self.branches = []
        self.shared = {}
        self.scheduler = None
        self.timesteps = None
        self.sigmas = None
        self.extra = {}
        self.inputs = None
        self.chunk_condition = None
        self.context = None


@dataclass(frozen=True)
class TeaCacheSupport:
    """How TeaCache (`diffserve.acceleration.teacache`) splits this family's denoiser forward.

    TeaCache needs the forward in three parts around the repeated blocks; `split` implements
    them for the family's denoiser class.

    Attributes:
        split: an object with ``embed(model, kwargs) -> (hidden, context, modulated)``,
            ``blocks(model, hidden, context) -> hidden`` and ``head(model, hidden, context) ->
            output`` (``context`` is whatever the blocks and the head need besides the image
            stream, sliced per row by TeaCache with `select_rows`), and
            ``select_rows(context, index) -> context``.
        coefficients: rescaling polynomial (``numpy.poly1d`` order) from the modulated-input
            relative L1 change to the output change.
        rel_l1_thresh: default threshold on the accumulated rescaled change.
        source: where the coefficients come from.
    """

    split: Any
    coefficients: tuple[float, ...]
    rel_l1_thresh: float
    source: str


@dataclass(frozen=True)
class CacheDiTSupport:
    """How cache-dit's DBCache wraps this family's denoiser.

    Attributes:
        blocks: attribute names of the block lists on the denoiser, in forward order.
        patterns: cache-dit ``ForwardPattern`` names, one per block list.
        has_encoder_residual: whether the last block returns an encoder stream (TaylorSeer's
            encoder calibrator needs it).
    """

    blocks: tuple[str, ...]
    patterns: tuple[str, ...]
    has_encoder_residual: bool = True


@dataclass(frozen=True)
class Capabilities:
    """What acceleration an adapter supports and how.

    Attributes:
        teacache: TeaCache forward split and coefficients, or None (backend refused).
        cache_dit: cache-dit block description, or None (backend refused).
        repeated_blocks: class names of the denoiser's repeated blocks for regional compile
            (default: the diffusers class's ``_repeated_blocks``), empty = refused.
        context_parallel: ``prepare(denoiser) -> plan``: installs what Ulysses sequence
            parallelism needs on the denoiser and returns its diffusers context-parallel plan;
            None = the diffusers class's own ``_cp_plan`` (refused when it has none).
    """

    teacache: TeaCacheSupport | None = None
    cache_dit: CacheDiTSupport | None = None
    repeated_blocks: tuple[str, ...] = ()
    context_parallel: Callable[[torch.nn.Module], dict] | None = None


@dataclass
class AdapterOptions:
    """Engine options an adapter reads when it is built.

    Attributes:
        context_folding: allow exact sequence-shortening tricks of the family (SD3 without T5:
            the 256 zero T5 rows as one token; Wan: the zero padding rows of the prompt as one).
        model_dir: the model folder (for `generation_config.json`).
    """

    context_folding: bool = True
    model_dir: Path | None = None


class PipelineAdapter(ABC):
    """Base class of the model-family adapters (one per diffusers pipeline class).

    Subclasses set `pipeline_class_name` (the ``_class_name`` in ``model_index.json``), build
    themselves from loaded components in `from_components`, and implement `encode_text`,
    `prepare_request`, `denoise_kwargs` and `decode`; the rest has shared defaults (collation of
    per-branch inputs, CFG combine, batched flow-matching step) that families override where
    their math differs.
    """

    pipeline_class_name: ClassVar[str]
    #: Components of the model's AR stage (e.g. ``("language_model", "tokenizer")``): a folder
    #: whose pipeline class lists some has an autoregressive stage before the DiT stage. The
    #: AR stage is built from them by `build_ar_stage` and runs in its own runner
    #: (`diffserve.runner.ar_stage`); the adapter is built without them. Empty: one stage.
    ar_stage_components: ClassVar[tuple[str, ...]] = ()

    device: torch.device
    dtype: torch.dtype
    spec: ModelSpec
    capabilities: Capabilities = Capabilities()
    #: LRU of prompt encodings installed by the model runner (None = off;
    #: `diffserve.acceleration.prompt_embed_cache.PromptEmbedCache`).
    prompt_embed_cache: "PromptCache | None" = None
    #: The family's text encoding through the prompt cache (set by subclasses).
    text: "TextEncoder | None" = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def component_loaders(cls) -> dict[str, Callable[[Path], Any]]:
        """Components this family loads itself, by their ``model_index.json`` name:
        ``loader(folder) -> component`` replaces the library's ``from_pretrained`` (e.g. a
        processor whose library class needs an optional dependency). Default: none."""
        return {}

    @classmethod
    @abstractmethod
    def from_components(cls, components: dict[str, Any], device: torch.device, dtype: torch.dtype,
                        options: AdapterOptions) -> "PipelineAdapter":
        """Build the adapter from the loaded components (moved to `device`)."""

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
    @abstractmethod
    def denoiser(self) -> torch.nn.Module:
        """The transformer/UNet called once per step (what caches and compile wrap)."""

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

    # --------------------------------------------------------------- per request
    def check_params(self, params: SamplingParams, inputs: RequestInputs | None) -> None:
        """Family-specific checks on resolved params (fields the family cannot honour).

        Raises:
            InvalidRequestError: naming the field.
        """
        if inputs is not None and (inputs.images or inputs.mask is not None):
            raise InvalidRequestError("image", "<image>", f"absent: {self.pipeline_class_name} "
                                      "is a text-to-image model without image inputs")

    def branches(self, params: SamplingParams) -> int:
        """Guidance branches of a request: 2 with CFG (unconditional + conditional rows), 1 without."""
        return 2 if params.guidance_scale is not None and params.guidance_scale > 1.0 else 1

    def rows(self, params: SamplingParams) -> int:
        """Denoiser rows a request adds to a step batch: images x branches."""
        return params.num_images_per_prompt * self.branches(params)

    def num_steps(self, params: SamplingParams, inputs: RequestInputs | None = None) -> int:
        """Denoising steps the request will run (what its progress events count and preview
        steps refer to): ``num_inference_steps``; image-to-image families that run only part
        of the schedule override it."""
        return params.num_inference_steps

    def batch_key(self, params: SamplingParams, inputs: RequestInputs | None = None) -> Hashable:
        """Requests with equal keys may share one denoise forward: (family, branches, latent
        size, dtype, `extra_batch_key`). Families whose sequence length depends on the input
        images (edits) extend it with `inputs`."""
        return (self.pipeline_class_name, self.branches(params), params.height, params.width,
                params.num_frames, self.dtype, self.extra_batch_key(params))

    def extra_batch_key(self, params: SamplingParams) -> Hashable:
        """Family-specific part of the batch key (e.g. a fixed text length); None = nothing."""
        return None

    def step_key(self, state: RequestState) -> Hashable:
        """The part of the batch key that may change while a request runs (plain, picklable
        data): requests whose next steps have different step keys never share a forward. E.g.
        Wan 2.2's two experts: the high-noise transformer runs the steps with timestep >= the
        boundary, then the low-noise one. The runner reports it after `prepare` and after every
        step (`Prepared.step_key`, `StepOutput.step_keys`); the request scheduler batches by
        (`batch_key`, step key). Default None: constant."""
        return None

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
        """Note prompt truncation, seed the request's generator, then `prepare_request`: encode
        the prompt(s), draw its latents and create its own diffusion scheduler with timesteps."""
        p = state.params
        state.prompt_truncated = self.prompt_is_truncated(state.prompt, p.max_sequence_length)
        if p.negative_prompt and self.branches(p) > 1:
            state.negative_prompt_truncated = self.prompt_is_truncated(p.negative_prompt, p.max_sequence_length)
        state.generator = torch.Generator(device="cpu").manual_seed(p.seed)
        state.step_index = 0
        self.prepare_request(state)

    @abstractmethod
    def prepare_request(self, state: RequestState) -> None:
        """Fill `state`: branches (per-branch denoiser inputs), shared inputs, latents,
        scheduler, timesteps, sigmas (for the batched step) and guidance_scale."""

    # ------------------------------------------------------------------ per step
    def model_input(self, state: RequestState) -> torch.Tensor:
        """This request's latent rows as the denoiser sees them (default: the latents; Euler-type
        schedulers scale them, edit families append reference latents). Not overriding it lets
        a repeated batch feed the previous step's concatenated latents straight in."""
        return state.latents

    def collate(self, states: list[RequestState]) -> StepBatch:
        """Gather the requests' rows into one forward, branch-major: rows ``b * N + i`` hold
        branch ``b`` of latent row ``i`` (N = total images). ``batch.inputs`` holds the
        per-branch inputs concatenated (padded where `pad_keys` says), ``hidden_states`` (rows,
        ...) and ``timestep`` (rows,), plus the shared inputs of the first request. A batch of
        the same requests as the previous step reuses all of it but latents and timesteps
        (`step_batch.BatchCache`)."""
        caches = self.__dict__.setdefault("_batch_caches", OrderedDict())
        key = tuple(id(s) for s in states)  # safe: a cache holds its states alive
        if key not in caches:  # a new composition: drop caches of batches a request of which finished
            for old in [k for k, c in caches.items() if any(s.latents is None for s in c.states)]:
                del caches[old]
        cache = caches.pop(key, None) or BatchCache()
        caches[key] = cache
        while len(caches) > _BATCH_CACHES:
            caches.popitem(last=False)
        overridden = type(self).model_input is not PipelineAdapter.model_input
        model_input = self.model_input if overridden else None
        return collate_branches(states, model_input, self.pad_keys(), cache)

    def pad_keys(self) -> dict[str, tuple[str | None, float]]:
        """Per-branch inputs of variable length: ``{key: (mask_key or None, pad_value)}``;
        they are right-padded along dim 1 to the batch's longest and ``mask_key`` (rows, L)
        bool marks the real tokens (None when no row is padded). Default: none."""
        return {}

    def denoise(self, batch: StepBatch, call: DenoiserCall | None = None) -> torch.Tensor:
        """One denoiser forward; returns the raw prediction for every row (rows, ...) in the
        latent layout. `call` replaces the plain module call (cache backends)."""
        kwargs = self.denoise_kwargs(batch)
        out = (call or self.call_denoiser)(batch, kwargs)
        return self.denoise_output(batch, out)

    @abstractmethod
    def denoise_kwargs(self, batch: StepBatch) -> dict[str, Any]:
        """Keyword arguments of the denoiser module for this batch."""

    def call_denoiser(self, batch: StepBatch, kwargs: dict[str, Any]) -> torch.Tensor:
        """The plain denoiser call (``module(**kwargs, return_dict=False)[0]``)."""
        return self.denoiser(**kwargs, return_dict=False)[0]

    def denoise_output(self, batch: StepBatch, out: torch.Tensor) -> torch.Tensor:
        """Post-process the module output into the latent layout (default: unchanged)."""
        return out

    def combine(self, batch: StepBatch, out: torch.Tensor) -> torch.Tensor:
        """Guided prediction (N, ...) from the (branches * N, ...) output: CFG
        ``uncond + w * (cond - uncond)`` (Ho & Salimans 2022) with each request's weight."""
        if batch.branches == 1:
            return out
        uncond, cond = out.chunk(2)
        scale = guidance.uniform_or_rows([s.guidance_scale for s in batch.states], batch.row_values)
        return guidance.cfg(uncond, cond, scale)

    def step(self, batch: StepBatch, guided: torch.Tensor) -> dict[str, BaseException]:
        """One diffusion-scheduler step for every request of `batch` (batched where the
        scheduler allows, see `diffusion_scheduler.step_batch`); returns per-request failures
        (the others stepped)."""
        return diffusion_scheduler.step_batch(batch, guided)

    # ------------------------------------------------------------ video streams
    #: Whether requests may stream video chunks (``num_chunks``, see
    #: `diffserve.pipelines.video_chunks`): the adapter implements `start_chunk` and
    #: `prompt_branch`.
    chunk_streaming: ClassVar[bool] = False
    #: Decoded frames a chunk after the first repeats from the end of the previous chunk (its
    #: conditioning frames); they are not emitted again.
    chunk_overlap_frames: ClassVar[int] = 0

    def start_chunk(self, state: RequestState, previous: Any) -> None:
        """Set `state` up for the next chunk of a stream, conditioned on the previous chunk:
        fresh latents from ``state.generator``, a fresh diffusion scheduler and timesteps,
        ``step_index`` 0 and ``state.chunk_condition``; the prompt inputs (``branches``) are
        the caller's.

        Args:
            previous: the previous chunk's decoded frames, uint8 numpy (F, H, W, 3).

        Raises:
            NotImplementedError: the family cannot stream chunks (`chunk_streaming` False).
        """
        raise NotImplementedError(f"{self.pipeline_class_name} cannot stream video chunks")

    def prompt_branch(self, state: RequestState, prompt: str) -> dict[str, Any]:
        """The conditional branch's denoiser inputs (``state.branches[-1]`` layout) for
        `prompt` with the request's other params, encoded through the prompt cache (an
        interaction's new prompt).

        Raises:
            NotImplementedError: the family cannot stream chunks.
        """
        raise NotImplementedError(f"{self.pipeline_class_name} cannot stream video chunks")

    # ------------------------------------------------------------------ decode
    @abstractmethod
    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Decode `latents` (default: the state's) into media of ``params.output_type``."""

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
