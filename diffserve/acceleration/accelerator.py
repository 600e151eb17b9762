"""`Accelerator`: the acceleration features of one loaded model, set up from `EngineConfig`.

The model runner builds one after loading the adapter and routes three calls through it:
`reset` at the start of every request, `denoise` for every step batch, `stats` for metrics.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch

from diffserve.acceleration.backend import CacheBackend
from diffserve.acceleration.compile import RegionalCompiler
from diffserve.acceleration.prompt_embed_cache import PromptEmbedCache
from diffserve.config import parse_cache_config

if TYPE_CHECKING:
    from diffserve.config import EngineConfig
    from diffserve.pipelines.base import PipelineAdapter, RequestState
    from diffserve.pipelines.step_batch import StepBatch

logger = logging.getLogger(__name__)


def build_cache_backend(adapter: "PipelineAdapter", backend: str, options: dict) -> CacheBackend:
    """Install the step-caching backend named `backend` on `adapter` (once, at load).

    Raises:
        InvalidRequestError: bad name or options, or the model family does not support the
            backend (the one-line message names both).
    """
    config = parse_cache_config(backend, options)
    if backend == "teacache":
        from diffserve.acceleration.teacache import TeaCacheBackend

        return TeaCacheBackend(adapter, config)
    if backend == "cache_dit":
        from diffserve.acceleration.cache_dit import CacheDiTBackend

        return CacheDiTBackend(adapter, config)
    return CacheBackend()


class Accelerator:
    """Prompt-embedding cache + step-caching backend + regional compile of one adapter.

    Args:
        adapter: the loaded pipeline adapter (modified in place: its
            ``prompt_embed_cache`` is set, cache hooks and compiled blocks are installed).
        config: ``prompt_embed_cache_size`` / ``_bytes``, ``cache_backend``, ``cache_config``,
            ``compile``, ``compile_vae`` and ``max_batch_size`` (warm-up sizes) are read.
        stage: ``stage(name)`` context that puts a work stage's components on the device
            (`OffloadManager.stage`) around each warm-up call; None = all are resident.
        warmup_contexts: context factories the compile warm-up runs every forward in, one
            pass each (the runner's LoRA rows on and off, so both graph variants exist);
            default: one pass without any.

    Raises:
        InvalidRequestError: a bad cache backend / options, or a backend or compile the model
            family does not support (the one-line message names both).
    """

    def __init__(self, adapter: "PipelineAdapter", config: "EngineConfig", stage=None, warmup_contexts=None):
        self.adapter = adapter
        self._warmup_contexts = list(warmup_contexts or [contextlib.nullcontext])
        self._stage = stage or (lambda name, **kw: contextlib.nullcontext(0))
        model_path = config.model_path
        self.prompt_cache: PromptEmbedCache | None = None
        if config.prompt_embed_cache_size > 0:
            self.prompt_cache = PromptEmbedCache(
                config.prompt_embed_cache_size, model=f"{model_path}:{config.load_format}",
                max_bytes=config.prompt_embed_cache_bytes)
        adapter.prompt_embed_cache = self.prompt_cache
        self.backend = build_cache_backend(adapter, config.cache_backend, config.cache_config)
        self.graphs = None
        if config.cuda_graphs:
            from diffserve.core.errors import InvalidRequestError

            if config.torch_device.type != "cuda":
                raise InvalidRequestError("cuda_graphs", True, "false: CUDA graphs need a CUDA device")
            if config.cache_backend != "none":
                raise InvalidRequestError("cuda_graphs", True, f"false with cache_backend={config.cache_backend} "
                                          "(its per-request decisions run between the blocks)")
        self.compiler: RegionalCompiler | None = None
        if config.compile:
            from diffserve.core.errors import InvalidRequestError

            blocks = adapter.capabilities.repeated_blocks or tuple(
                getattr(adapter.denoiser, "_repeated_blocks", None) or ())
            if not blocks:
                raise InvalidRequestError("compile", True, f"false: {adapter.pipeline_class_name} declares no "
                                          "repeated blocks for regional compile")
            vae = adapter.vae
            decoder = vae.decoder if config.compile_vae and vae is not None else None
            self.compiler = RegionalCompiler(adapter.denoiser, blocks, decoder)
            self.compiler.apply()
            self.compiler.warm_up(self._warmup_calls(config, decode=decoder is not None))
        if config.cuda_graphs:  # after compile: the compiled kernels are what gets captured
            from diffserve.acceleration.cuda_graphs import CudaGraphDenoiser

            self.graphs = CudaGraphDenoiser(adapter.call_denoiser, config.max_batch_size)

    @property
    def shares_forward(self) -> bool:
        """Whether requests of a step batch may share one denoiser forward."""
        return self.backend.shares_forward

    def save(self, states: list["RequestState"]) -> Any:
        """The cache backend's per-request state of `states` (opaque; None for the ``none``
        backend), to `restore` if a shared step fails after its forward (`CacheBackend.save`)."""
        return self.backend.save(states)

    def restore(self, states: list["RequestState"], saved: Any) -> None:
        """Put back what `save` returned (`CacheBackend.restore`)."""
        self.backend.restore(states, saved)

    def check_params(self, params) -> None:
        """Refuse a ``cache_quality`` the cache backend cannot honour (`CacheBackend.check_params`)."""
        self.backend.check_params(params)

    def request_summary(self, state: "RequestState") -> dict[str, Any] | None:
        """The request's caching record for its metrics (`CacheBackend.request_summary`)."""
        return self.backend.request_summary(state)

    def reset(self, state: "RequestState") -> None:
        """Fresh caching state for a request (after `prepare`: its step count is known)."""
        self.backend.reset(state)

    def denoise(self, batch: "StepBatch") -> torch.Tensor:
        """The denoiser forward of a step batch through the cache backend (or CUDA graphs;
        not for batches with LoRA rows: a replayed graph would skip their deltas)."""
        if self.graphs is not None and "loras" not in batch.row_data:
            out = self.adapter.denoise(batch, call=self.graphs)
            self.backend.transformer_calls += len(batch.states)
            return out
        return self.backend.denoise(self.adapter, batch)

    def _warmup_calls(self, config: "EngineConfig", decode: bool) -> list:
        """Denoiser forwards at 1, 2 and ``max_batch_size`` rows where the family's requests
        can form them (the default request, and a guidance-free one, repeated; default
        resolution; a gray input image for models that take images), with `mixed_sizes` one
        forward of the default request beside one of half its height (the token-span path), with
        a masked `PipelineAdapter.padded_inputs` (Qwen-Image's text mask) the 2-row and larger
        forwards and the mixed one again with one row's prompt longer (the padded path: the mask
        is a graph input that is None or a tensor), and one decode, so compiled graphs exist before the first
        request."""
        from PIL import Image

        from diffserve.core.inputs import RequestInputs
        from diffserve.pipelines.base import RequestState
        from diffserve.core.sampling_params import SamplingParams

        adapter = self.adapter
        spec = adapter.spec
        inputs = None
        if spec.accepts_images:
            inputs = RequestInputs(images=[Image.new("RGB", (spec.default_width, spec.default_height), (128,) * 3)])
        # 2 steps: a 1-step schedule is invalid for some schedulers (Qwen-Image's shift_terminal)
        variants = [SamplingParams(seed=0, num_inference_steps=2, output_type="np")]
        if spec.default_guidance_scale is not None:
            variants.append(SamplingParams(seed=0, num_inference_steps=2, output_type="np", guidance_scale=1.0))
        factor = spec.resolution_factor
        smaller = max(factor, spec.default_height // 2 // factor * factor)
        mixed = adapter.mixed_sizes and smaller != spec.default_height  # the token-span path compiles too
        if mixed:
            variants.append(SamplingParams(seed=0, num_inference_steps=2, output_type="np", height=smaller))
        # a masked padded input: each variant again with a longer prompt, batched beside the short one
        masked = any(mask is not None for mask, _ in adapter.padded_inputs.values())
        prompts = ("warm-up", "a longer warm-up prompt, padded beside the short one") if masked else ("warm-up",)
        states, twins = [], []
        adapter.prompt_embed_cache = None  # warm-up prompts are not traffic
        try:
            with torch.inference_mode(), self._stage("encode"):
                for params in variants:
                    for prompt, into in zip(prompts, (states, twins)):
                        state = RequestState("warm-up", prompt, params.resolve(spec, config.limits, 0), inputs=inputs)
                        adapter.prepare(state)
                        into.append(state)
        finally:
            adapter.prompt_embed_cache = self.prompt_cache

        def forward(state, copies: int):
            with torch.inference_mode(), self._stage("denoise"):
                adapter.denoise(adapter.collate([state] * copies))

        def forward_rows(batch):  # requests of different sizes / text lengths in one forward
            with torch.inference_mode(), self._stage("denoise"):
                adapter.denoise(adapter.collate(batch))

        def decode_once():
            with torch.inference_mode(), self._stage("decode"):
                adapter.decode(states[0])

        mixed_pair = [states.pop(), states[0]] if mixed else None
        if mixed and twins:
            twins.pop()
        plans = {}
        for target in (1, 2, config.max_batch_size):
            for i, state in enumerate(states):
                rows = adapter.rows(state.params)
                if rows <= target:
                    plans[target // rows * rows] = (i, target // rows)
        calls = [lambda i=i, copies=copies, context=context: _within(context, forward, states[i], copies)
                 for context in self._warmup_contexts for _, (i, copies) in sorted(plans.items())]
        calls += [lambda i=i, copies=copies, context=context: _within(context, forward_rows,
                                                                      [states[i]] * (copies - 1) + [twins[i]])
                  for context in self._warmup_contexts for _, (i, copies) in sorted(plans.items())
                  if twins and copies >= 2]
        if mixed_pair is not None and adapter.rows(mixed_pair[0].params) * 2 <= config.max_batch_size:
            pairs = [mixed_pair] + ([[mixed_pair[0], twins[0]]] if twins else [])  # also sizes and texts
            calls += [lambda pair=pair, context=context: _within(context, forward_rows, pair)
                      for context in self._warmup_contexts for pair in pairs]
        if decode:
            calls.append(decode_once)
        return calls

    def stats(self) -> dict[str, Any]:
        """``{"prompt_embed_cache": ..., "cache_backend": ..., "compile": ...}``: see
        `PromptEmbedCache.stats`, `CacheBackend.stats`, `RegionalCompiler.stats`; a disabled
        feature reports ``{"enabled": False}``."""
        return {
            "prompt_embed_cache": ({"enabled": True, **self.prompt_cache.stats()}
                                   if self.prompt_cache is not None else {"enabled": False}),
            "cache_backend": self.backend.stats(),
            "compile": self.compiler.stats() if self.compiler is not None else {"enabled": False},
            "context_folding": {"enabled": bool(getattr(self.adapter, "context_folding", False))},
            "cuda_graphs": self.graphs.stats() if self.graphs is not None else {"enabled": False},
        }


def _within(context, fn, *args):
    """``fn(*args)`` inside ``context()``."""
    with context():
        return fn(*args)
