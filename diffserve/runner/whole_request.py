"""`WholeRequestRunner`: serve any diffusers pipeline class without a step adapter.

Coverage is never zero: a folder whose pipeline class has no adapter (PixArt, SANA, AuraFlow, SD
img2img / inpaint, a user's own pipeline class, ...) is loaded with its own class and each
request runs the pipeline's own ``__call__``. It still goes through the engine's queue, limits,
metrics, events and abort, one denoising step at a time:

- each request gets a shallow copy of the pipeline with its own diffusion-scheduler instance
  (the modules are shared, the per-call state is not), and its ``__call__`` runs on a thread of
  its own that pauses in ``callback_on_step_end`` after every step until the engine asks for the
  next one, so a progress event follows every step and the engine stays in control between
  steps (the request scheduler runs the oldest request first: with no forward to share, requests
  run in arrival order, each to its end);
- an abort raises out of that callback at the next step boundary (diffusers' ``interrupt`` flag
  would still run the remaining loop and the VAE decode), which frees the request at once;
- requests never share a forward (each has its own batch key): there is no step batching, and
  the server says so in ``/v1/models`` and the log.

Whatever else the class's ``__call__`` takes passes through by name (``SamplingParams.extra``,
checked against the signature when the request is added: `ModelSpec.extra_parameters`), e.g.
``pag_scale`` of the PAG pipelines or ``eta`` of ``DDIMPipeline``. Classes that take no prompt
(unconditional ``DDIMPipeline``, ``DDPMPipeline``) run with an empty prompt (a non-empty one is
refused as unused); ``num_images_per_prompt`` becomes their ``batch_size``; a size is refused
when the call takes none (the model's is fixed). Classes whose ``__call__`` has no
``callback_on_step_end`` pause in the legacy ``callback`` (every step) where they have one;
without either, a request runs whole in its first engine step (no per-step progress or abort,
said at load). A class whose ``__call__`` takes no ``generator`` is refused at load: diffserve
seeds every request.

Outputs are the pipeline's own, so parity with diffusers holds by construction.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import logging
import threading
import time
from typing import Any

import torch

from diffserve.core.errors import InvalidRequestError, UnsupportedModelError
from diffserve.core.inputs import MAX_INPUT_IMAGES
from diffserve.core.messages import Decoded, ModelInfo, NewRequest, Prepared, RequestPlan, StepOutput, WorkError
from diffserve.pipelines.diffusion_scheduler import new_scheduler
from diffserve.memory.accounting import peak_memory_bytes
from diffserve.core.sleep_levels import check_level
from diffserve.memory.sleep import WeightSleeper
from diffserve.quantization.plan import apply_plan
from diffserve.runner.quantization import quantize_pipeline
from diffserve.runner.base import Runner
from diffserve.core.sampling_params import ModelSpec, SamplingParams

logger = logging.getLogger(__name__)

#: SamplingParams field -> the ``__call__`` argument that takes it (when it has one).
_CALL_ARGUMENTS = {
    "negative_prompt": "negative_prompt",
    "num_images_per_prompt": "num_images_per_prompt",
    "height": "height",
    "width": "width",
    "num_inference_steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "true_cfg_scale": "true_cfg_scale",
    "max_sequence_length": "max_sequence_length",
    "num_frames": "num_frames",
    "strength": "strength",
}
#: ``__call__`` arguments diffserve sets itself (from the prompt, the inputs, the seed, the output
#: type, the step callback), so never through ``SamplingParams.extra``.
_RESERVED = frozenset({"prompt", "generator", "output_type", "return_dict", "callback_on_step_end",
                       "callback_on_step_end_tensor_inputs", "callback", "callback_steps", "image", "mask_image",
                       "batch_size"}) | frozenset(_CALL_ARGUMENTS.values())


def call_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The named parameters of ``cls.__call__``, looking through wrappers that take
    ``*args, **kwargs`` to the first class in the MRO that names its parameters."""
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        call = klass.__dict__.get("__call__")
        if call is None:
            continue
        for name, p in inspect.signature(call).parameters.items():
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name != "self":
                params.setdefault(name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(call).parameters.values()):
            break
    return params


def _videos(frames: Any, output_type: str) -> Any:
    """diffusers' video output as diffserve's: one entry per video, uint8 (F, H, W, 3) arrays
    (``np``) / tensors (``pt``), PIL frame lists (``pil``), latents unchanged."""
    import numpy as np

    if output_type == "np":
        return [(np.clip(v, 0, 1) * 255).round().astype(np.uint8) for v in np.asarray(frames)]
    if output_type == "pt":  # (B, F, C, H, W) float in [0, 1]
        return [(v.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1) for v in frames]
    return frames


class _Aborted(Exception):
    """Raised inside ``callback_on_step_end`` to stop an aborted request's pipeline call."""


class _Job:
    """One request's pipeline call on its own thread, advanced one denoising step at a time.

    Args:
        pipe: the request's own pipeline copy.
        kwargs: ``__call__`` arguments (callback excluded).
        guess_steps: steps reported until the pipeline says how many it runs.
    """

    def __init__(self, request_id: str, pipe: Any, kwargs: dict[str, Any], guess_steps: int,
                 hook: str | None = "callback_on_step_end"):
        self.pipe = pipe
        self.hook = hook
        self.kwargs = kwargs
        self.loras: dict[str, float] = {}
        self.steps_done = 0
        self.num_steps = guess_steps
        self.output: Any = None
        self.error: BaseException | None = None
        self.finished = False
        self.aborted = False
        self._go = threading.Semaphore(0)
        self._reached = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, name=f"diffserve-call-{request_id[:8]}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._go.acquire()
        try:
            if not self.aborted:
                hooks = {}
                if self.hook == "callback_on_step_end":
                    hooks = {"callback_on_step_end": self._callback}
                elif self.hook == "callback":  # the legacy per-step callback (i, t, latents)
                    hooks = {"callback": lambda i, t, latents: self._callback(self.pipe, i, t, {}),
                             "callback_steps": 1}
                with torch.inference_mode():
                    self.output = self.pipe(**self.kwargs, **hooks)
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported as the request's failure
            self.error = exc
        finally:
            self.finished = True
            self.steps_done = max(self.steps_done, self.num_steps)
            self._reached.release()

    def _callback(self, pipe, i: int, t, callback_kwargs: dict) -> dict:
        self.steps_done = i + 1
        self.num_steps = int(getattr(pipe, "_num_timesteps", None) or self.num_steps)
        self._reached.release()
        self._go.acquire()
        if self.aborted:
            raise _Aborted()
        return {}

    def advance(self) -> None:
        """Let the call run to its next step boundary (or its end) and wait for it."""
        if self.finished:
            return
        self._go.release()
        self._reached.acquire()

    def abort(self) -> None:
        """Stop the call at its next step boundary (does not wait)."""
        self.aborted = True
        if not self.finished:
            self._go.release()


class WholeRequestRunner(Runner):
    """Runs requests through a diffusers pipeline's own ``__call__`` (see the module docstring).

    Args:
        pipe: the loaded pipeline (any `DiffusionPipeline` subclass, or a user class with a
            diffusers-style ``__call__`` taking ``prompt``, ``generator``, ``output_type`` and
            ``callback_on_step_end``).
        config: the engine configuration (device, num_threads).
    """

    def __init__(self, pipe: Any, config):
        if config.cache_backend != "none" or config.compile:
            feature = f"cache_backend={config.cache_backend}" if config.cache_backend != "none" else "compile"
            raise InvalidRequestError(feature.split("=")[0], config.cache_backend if config.cache_backend != "none"
                                      else True, f"off: {type(pipe).__name__} has no step adapter (it runs "
                                      "whole requests through diffusers' own pipeline call)")
        for name in ("cpu_offload", "layerwise_offload"):
            if getattr(config, name, False):
                raise InvalidRequestError(name, True, f"false: {type(pipe).__name__} has no step adapter (its own "
                                          "pipeline call moves the components, not diffserve's stages)")
        self.config = config
        self.pipe = pipe
        self.device = config.torch_device
        self.class_name = type(pipe).__name__
        self.signature = call_parameters(type(pipe))
        if "generator" not in self.signature:
            raise UnsupportedModelError(f"{self.class_name}.__call__ takes no generator: diffserve seeds every request "
                                        "(to reproduce it from its seed) and cannot serve it")
        #: how the call pauses at step boundaries: "callback_on_step_end", "callback" (legacy) or None
        self.hook = next((h for h in ("callback_on_step_end", "callback") if h in self.signature), None)
        if self.hook is None:
            logger.warning("%s.__call__ has no step callback: each request runs to its end in one engine step "
                           "(no per-step progress, previews or abort mid-run)", self.class_name)
        self.quantization = quantize_pipeline(pipe, config)
        from diffserve.models.model_index import with_stated_limits

        self.spec = with_stated_limits(self._spec(), config.model_path)
        self.states: dict[str, _Job] = {}
        self.nonfinite_count = 0
        self._keys = itertools.count()
        self.sleeper = WeightSleeper(self._modules, self._reload_components, self.device)
        #: LoRA adapters: diffusers' own ``load_lora_weights`` into the live pipeline and
        #: ``set_adapters`` before each request's step (no two requests share a forward here);
        #: the lock keeps a load's PEFT injection out of a running step
        self._loras: dict[str, dict[str, Any]] = {}
        self._active_loras: dict[str, float] | None = None
        self._lora_lock = threading.Lock()
        logger.warning("%s has no step adapter: requests run whole through diffusers' own pipeline call, "
                       "one step at a time, without step batching", self.class_name)

    def _default(self, name: str) -> Any:
        p = self.signature.get(name)
        return None if p is None or p.default is inspect.Parameter.empty else p.default

    def _spec(self) -> ModelSpec:
        pipe = self.pipe
        vae_factor = int(getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
                         or (8 if getattr(pipe, "vae", None) is not None else 1))  # pixel-space models: 1
        denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
        patch = getattr(getattr(denoiser, "config", None), "patch_size", None) or 1
        patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
        sample = getattr(pipe, "default_sample_size", None) or getattr(getattr(denoiser, "config", None),
                                                                     "sample_size", None) or 64
        sample = sample[-1] if isinstance(sample, (tuple, list)) else sample
        has = self.signature.__contains__
        guidance = self._default("guidance_scale")
        return ModelSpec(
            pipeline=self.class_name,
            resolution_factor=vae_factor * int(patch),
            default_height=int(self._default("height") or sample * vae_factor),
            default_width=int(self._default("width") or sample * vae_factor),
            default_num_inference_steps=int(self._default("num_inference_steps") or 50),
            default_guidance_scale=float(guidance if guidance is not None else 1.0) if has("guidance_scale") else None,
            default_true_cfg_scale=float(self._default("true_cfg_scale") or 1.0) if has("true_cfg_scale") else None,
            default_max_sequence_length=(int(self._default("max_sequence_length") or 512)
                                         if has("max_sequence_length") else None),
            max_sequence_length_limit=4096 if has("max_sequence_length") else None,
            text_conditioned=has("prompt"),
            default_num_frames=int(self._default("num_frames")) if has("num_frames") and self._default("num_frames")
            else None,
            accepts_images=has("image"),
            max_input_images=MAX_INPUT_IMAGES,  # whatever its ``image`` takes (a list or one)
            accepts_mask=has("mask_image"),
            default_strength=float(self._default("strength")) if has("strength") and self._default("strength")
            else None,
            extra_parameters=tuple(sorted(n for n in self.signature if n not in _RESERVED)),
        )

    # ------------------------------------------------------------------ model facts
    def info(self) -> ModelInfo:
        """The pipeline's spec (from its ``__call__`` defaults); no step batching, no chunk
        streaming; what was quantized at load."""
        return ModelInfo(spec=self.spec, pipeline=self.class_name, step_batching=False,
                         quantization=self.quantization.summary())

    def plan(self, params: SamplingParams, inputs: Any = None) -> RequestPlan:
        """One row, and a batch key of its own (never batched).

        Raises:
            InvalidRequestError: an input the pipeline's ``__call__`` does not take, or
                ``num_chunks`` (whole requests do not stream chunks).
        """
        if params.num_chunks is not None:
            raise InvalidRequestError("num_chunks", params.num_chunks, f"unset: {self.class_name} is served "
                                      "whole-request (no step adapter), which cannot stream video chunks")
        if params.cache_quality not in (None, "max"):
            raise InvalidRequestError("cache_quality", params.cache_quality, f"unset or max: {self.class_name} is "
                                      "served whole-request (no step adapter), which has no step caching")
        for field, default in (("height", self.spec.default_height), ("width", self.spec.default_width)):
            value = getattr(params, field)
            if field not in self.signature and value != default:
                raise InvalidRequestError(field, value, f"{default}: {self.class_name} makes images of one size (its "
                                          f"__call__ takes no {field})")
        if inputs is not None:
            if inputs.images and "image" not in self.signature:
                raise InvalidRequestError("image", "<image>", f"absent: {self.class_name} takes no input image")
            if inputs.mask is not None and "mask_image" not in self.signature:
                raise InvalidRequestError("mask", "<mask>", f"absent: {self.class_name} takes no mask")
        return RequestPlan(rows=params.num_images_per_prompt, batch_key=("whole-request", next(self._keys)),
                           num_steps=params.num_inference_steps)

    # ------------------------------------------------------------------ work items
    def _kwargs(self, new: NewRequest) -> dict[str, Any]:
        p = new.params
        kwargs: dict[str, Any] = {"prompt": new.prompt} if "prompt" in self.signature else {}
        for field, argument in _CALL_ARGUMENTS.items():
            value = getattr(p, field)
            if value is not None and argument in self.signature:
                kwargs[argument] = value
        if "num_images_per_prompt" not in self.signature and "batch_size" in self.signature:
            kwargs["batch_size"] = p.num_images_per_prompt  # unconditional pipelines: images per call
        kwargs.update(p.extra or {})
        generators = [torch.Generator(device="cpu").manual_seed(seed) for seed in p.image_seeds()]
        kwargs["generator"] = generators[0] if len(generators) == 1 else generators  # image i: seed + i
        if "output_type" in self.signature:
            kwargs["output_type"] = p.output_type
        inputs = new.inputs
        if inputs is not None and inputs.images:
            kwargs["image"] = inputs.images[0] if len(inputs.images) == 1 else list(inputs.images)
            if inputs.mask is not None:
                kwargs["mask_image"] = inputs.mask
        return kwargs

    def prepare(self, requests: list[NewRequest]) -> list[Prepared]:
        """Give each request its own pipeline copy (own diffusion scheduler) and a paused
        call thread; the prompt is encoded inside the call, during its first step."""
        results = []
        for new in requests:
            start = time.perf_counter()
            try:
                pipe = copy.copy(self.pipe)
                if getattr(self.pipe, "scheduler", None) is not None:
                    vars(pipe)["scheduler"] = new_scheduler(self.pipe.scheduler)
                job = _Job(new.request_id, pipe, self._kwargs(new), new.params.num_inference_steps, self.hook)
                job.loras = dict(new.params.loras or {})
                missing = [name for name in job.loras if name not in self._loras]
                if missing:
                    raise InvalidRequestError("loras", job.loras, "names of loaded LoRA adapters",
                                              detail=f"{missing[0]!r} is not loaded")
            except Exception as exc:  # noqa: BLE001
                results.append(Prepared(new.request_id, error=WorkError.of(exc)))
                continue
            self.states[new.request_id] = job
            results.append(Prepared(new.request_id, num_steps=job.num_steps, seconds=time.perf_counter() - start))
        return results

    def snapshot(self, request_ids: list[str]) -> dict:
        """Previews are not available without a step adapter (nothing to snapshot)."""
        return {}

    def step(self, request_ids: list[str]) -> StepOutput:
        """Advance each request's call by one denoising step (one request per forward)."""
        start = time.perf_counter()
        out = StepOutput(num_rows=0)
        for request_id in request_ids:
            job = self.states[request_id]
            with self._lora_lock:
                self._use_loras(job.loras)
                job.advance()
            if job.error is not None:
                out.errors[request_id] = WorkError.of(job.error)
                self.free([request_id])
                continue
            out.num_rows = max(out.num_rows, job.kwargs.get("num_images_per_prompt", 1))
            out.steps_done[request_id] = job.steps_done
            out.num_steps[request_id] = job.num_steps
        out.seconds = time.perf_counter() - start
        return out

    def decode(self, request_ids: list[str], preview: bool = False, snapshots: dict | None = None) -> list[Decoded]:
        """Let each finished request's call return (its pipeline decodes) and take its output."""
        if preview:
            return []
        results = []
        for request_id in request_ids:
            job = self.states.pop(request_id, None)
            if job is None:
                continue
            start = time.perf_counter()
            while not job.finished:
                job.advance()
            if job.error is not None:
                results.append(Decoded(request_id, error=WorkError.of(job.error)))
                continue
            output = job.output
            media = getattr(output, "images", None)
            if media is None and getattr(output, "frames", None) is not None:
                media = _videos(output.frames, job.kwargs.get("output_type", "pil"))
            if media is None and isinstance(output, tuple):
                media = output[0]
            results.append(Decoded(request_id, output=media, step=job.steps_done,
                                   seconds=time.perf_counter() - start))
        return results

    def free(self, request_ids: list[str]) -> None:
        """Stop and drop requests' calls (unknown ids are ignored)."""
        for request_id in request_ids:
            job = self.states.pop(request_id, None)
            if job is not None:
                job.abort()

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Check the adapter at `path` against the model (`diffserve.lora.reading`), then load
        it into the live pipeline with its class's ``load_lora_weights`` as `name`.

        Raises:
            InvalidRequestError: (field ``path``) see `diffserve.lora.reading.read_lora`.
            LoraInUseError: a request holds an adapter of that name.
        """
        from diffserve.lora.reading import read_lora, text_encoder_loader

        info = read_lora(path, self.pipe, name).info()
        with self._lora_lock:
            if name in self._loras:
                self._unload(name)
            # text encoders through PEFT directly: transformers 5.24's load_adapter wants peft >= 0.22
            self.pipe.load_lora_into_text_encoder = text_encoder_loader(self.pipe)
            self.pipe.load_lora_weights(path, adapter_name=name, low_cpu_mem_usage=False)
            self._loras[name] = info
            self._active_loras = None
        return info

    def unload_lora(self, name: str) -> None:
        """Delete adapter `name` from the live pipeline.

        Raises:
            LoraInUseError: a request holds it.
        """
        with self._lora_lock:
            if name in self._loras:
                self._unload(name)

    def _unload(self, name: str) -> None:
        from diffserve.core.errors import LoraInUseError

        users = [r for r, job in self.states.items() if name in job.loras]
        if users:
            raise LoraInUseError(f"LoRA {name!r} is used by {len(users)} request(s)")
        self.pipe.delete_adapters(name)
        del self._loras[name]
        self._active_loras = None

    def _use_loras(self, loras: dict[str, float]) -> None:
        """Make `loras` the pipeline's active adapters (diffusers' ``set_adapters``; none:
        ``disable_lora``), if they are not already (lock held)."""
        if not self._loras or loras == self._active_loras:
            return
        if loras:
            self.pipe.enable_lora()
            self.pipe.set_adapters(list(loras), list(loras.values()))
        else:
            self.pipe.disable_lora()
        self._active_loras = dict(loras)

    # ------------------------------------------------------------------ stats
    def acceleration_stats(self) -> dict[str, Any]:
        """No acceleration backends without a step adapter."""
        return {"prompt_embed_cache": {"enabled": False}, "cache_backend": {"name": "none"},
                "compile": {"enabled": False}, "context_folding": {"enabled": False}}

    def peak_memory_bytes(self) -> int:
        """CUDA allocator peak on GPU; process peak RSS on CPU (bytes)."""
        return peak_memory_bytes(self.device)

    # ------------------------------------------------------------------ sleep mode
    def _modules(self) -> dict[str, torch.nn.Module]:
        return {n: m for n, m in getattr(self.pipe, "components", {}).items() if isinstance(m, torch.nn.Module)}

    def _reload_components(self) -> dict[str, Any]:
        from diffserve.runner.loader import load_components

        config = self.config
        load_format = "default" if config.load_format == "custom_pipeline" else config.load_format
        components = load_components(config.model_path, config.torch_dtype, load_format, device=self.device,
                                     variant=config.variant, transformer_file=config.transformer_file)[1]
        apply_plan(components, self.quantization.plan, config.torch_dtype)  # as quantized at load
        return components

    def sleep(self, level: int) -> None:
        """Sleep mode (see `diffserve.memory.sleep`); no request may be held.

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
            RuntimeError: requests are still held.
        """
        level = check_level(level)
        if self.states:
            raise RuntimeError(f"cannot sleep with {len(self.states)} requests in the runner")
        self.sleeper.sleep(level)

    def wake_up(self) -> None:
        """Restore the weights (no-op while awake)."""
        self.sleeper.wake_up()
