"""`EngineConfig`: how the engine loads and runs a model, and the options of its cache
backends (`TeaCacheConfig`, `CacheDiTConfig`).

Importing this module imports neither torch nor any other layer of diffserve than the shared
types (`diffserve.core`) and the built-in model names (`diffserve.models`): the CLI and the
server build and check a config before loading anything heavy. torch is imported when a config
resolves its device or dtype (`EngineConfig.torch_device`, also checked at construction).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffserve.core.errors import InvalidRequestError
from diffserve.core.quantization import DEFAULT_ERROR_BUDGET, QuantizationSpec, check_device
from diffserve.core.sampling_params import CACHE_QUALITY_LEVELS, MAX_SEED, RequestLimits

if TYPE_CHECKING:
    import torch

EXECUTION_MODES = ("step", "request")
EXECUTORS = ("auto", "inprocess", "multiprocess")
#: `EngineConfig.scheduling_policy` values (vLLM's ``--scheduling-policy`` plus ``slo``).
SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
#: `EngineConfig.admission` values.
ADMISSION_MODES = ("all", "slo")
LOAD_FORMATS = ("default", "dummy", "custom_pipeline")
#: ``dtype`` values -> the torch dtype's attribute name.
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
           "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


@dataclass
class EngineConfig:
    """Engine configuration.

    Attributes:
        model: path to a local diffusers folder (with ``model_index.json``), the name of a
            built-in model: ``"digits"`` (text-to-image, the default) or ``"digits-video"``
            (text-to-video), or a Hugging Face Hub id ``"ORG/NAME"`` / ``"ORG/NAME@REVISION"``
            (fetched into the Hub cache when the engine starts: `diffserve.models.hub`); None =
            ``"digits"``. An existing folder wins over a built-in name and a Hub id (see
            `diffserve.models.resolve_model`).
        download_dir: where a Hub id's files are cached (huggingface_hub's ``cache_dir``);
            None = the library's cache (``HF_HUB_CACHE``, ``~/.cache/huggingface/hub``).
        variant: weights variant to load (``"fp16"``, ``"bf16"``...: the components'
            ``*.VARIANT.safetensors``, diffusers' ``variant``), and to fetch for a Hub id;
            None = the variant-less weights.
        device: ``"auto"`` (cuda if available, else cpu), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        dtype: ``"auto"`` (bf16 on cuda, fp32 on cpu), ``"fp32"``, ``"bf16"``, ``"fp16"``.
        load_format: ``"default"`` reads the weights; ``"dummy"`` builds every model from its
            config with seeded random weights (no weight file read); ``"custom_pipeline"``
            reads the weights into the class named by `custom_pipeline` (as vLLM-Omni's runner).
        custom_pipeline: ``"package.module:ClassName"``: a `PipelineAdapter` subclass
            (served with step batching) or a pipeline class with a diffusers-style ``__call__``
            (served whole-request, one step at a time); None = the folder's own class.
        max_batch_size: most transformer rows in one denoising step (a request with CFG on
            takes 2 x num_images_per_prompt rows); also the most rows admitted at once.
        max_waiting_requests: bound of the waiting queue; past it `add_request` raises
            `EngineOverloadedError`.
        execution_mode: ``"step"`` (continuous batching, one denoising step at a time) or
            ``"request"`` (static batches run to completion).
        scheduling_policy: ``"fcfs"`` (arrival order; the default), ``"priority"`` (lowest
            ``SamplingParams.priority`` first, preempting at step boundaries) or ``"slo"``
            (least slack to ``deadline_s`` first, from an online cost model of step time;
            preempting at step boundaries). See `diffserve.engine.queues` (step mode only).
        mixed_sizes: let requests of different sizes share a denoiser forward in the families
            that can (`PipelineAdapter.mixed_sizes`: SD3 and the built-in digits model, Flux,
            Flux Kontext, Qwen-Image, Wan (also different frame counts); not under Ulysses
            sequence parallelism); False batches by size as before (the benchmark's baseline arm).
        length_groups: in an eager mixed-size forward, run the family's repeated blocks once
            per row size on each size's real tokens only (`diffserve.pipelines.length_groups`;
            SD3 and the built-in digits models, Flux, Flux Kontext, Qwen-Image, Qwen-Image-Edit,
            Wan); False runs them once over the padded rows with masks (one call per block:
            fewer, larger kernels, which can win where per-call overhead dominates, e.g. small
            models on a GPU). Compiled blocks always take the padded path.
        aging_s: under ``priority`` / ``slo``, a request that arrived more than this many
            seconds ago is served in arrival order ahead of every younger one (the bound on
            waiting: nothing starves); past it, the padding cap no longer holds a request back.
        max_padding_ratio: the padding cap, in [0, 1]: a step batch of mixed sizes admits a
            request only while the forward's padded share (padded image tokens / all image
            token slots: rows x the widest row's tokens) stays within it; the oldest (or
            best-ranked) request, requests older than ``aging_s`` and, while the head is
            unchanged, the members of the previous step are exempt (`diffserve.engine.queues`).
            0 = rows of different token counts never share a forward; 1 = no cap. ``"auto"``:
            no fixed cap; a request joins only if the step cost model predicts no fewer real
            image tokens per second with it (its extra padded slots cost more than its tokens
            bring otherwise).
        admission: ``"all"`` (queue every valid request) or ``"slo"`` (refuse at arrival, with
            `DeadlineUnmeetableError`, a request whose ``deadline_s`` the cost model predicts it
            cannot meet).
        default_seed: seed for requests that give none; None draws a random one per request
            (always reported back in the output).
        max_num_inference_steps / max_pixels / max_num_images_per_prompt / max_num_frames /
            max_num_chunks: request limits (frames of a video or of a stream's chunk, below
            the model's own limit; chunks of a video stream).
        num_threads: torch intra-op threads to set (None leaves torch's default).
        prompt_embed_cache_size: entries of the prompt-embedding LRU (0 = off); see
            `diffserve.acceleration.prompt_embed_cache`.
        prompt_embed_cache_bytes: bound of that cache in bytes of tensor storage (default
            256 MiB).
        overlap_stages: run prompt encoding and VAE decode on a side thread, overlapping the
            denoising steps of other requests (False: inline, in a deterministic order).
        cache_backend: step caching: ``"none"``, ``"teacache"`` or ``"cache_dit"`` (see
            `diffserve.acceleration`); its state is reset at the start of every request.
        cache_config: options of the cache backend (keys of `TeaCacheConfig` /
            `CacheDiTConfig`; empty = that backend's defaults).
        compile: regional ``torch.compile`` of the denoiser's repeated blocks, warmed up at
            startup (falls back to eager with a warning if compiling fails).
        compile_vae: also compile the VAE decoder (only with ``compile``).
        cfg_parallel_size: ranks splitting each forward's rows (2: one guidance branch each;
            `diffserve.parallel.cfg`).
        ulysses_degree: ranks splitting each forward's token sequence (Ulysses;
            `diffserve.parallel.ulysses`). cfg_parallel_size x ulysses_degree worker processes.
        executor: ``"auto"`` (in-process for one rank, multi-process otherwise),
            ``"inprocess"`` or ``"multiprocess"`` (workers in child processes even for one rank).
        cuda_graphs: replay the denoiser forward from CUDA graphs captured per row bucket
            (`diffserve.acceleration.cuda_graphs`); CUDA devices only, not with a cache backend.
        context_folding: let a family run identical placeholder context tokens as one token
            (SD3 without T5: the 256 zero rows, with a +log(k) attention bias; Wan text-to-video:
            the zero padding rows up to max_sequence_length); same images within float
            rounding, far less compute.
        cpu_offload: model CPU offload, serving-aware: components live on the CPU and move to
            the device for their stage; the denoiser stays while any request is denoising (see
            `diffserve.memory.offload`).
        layerwise_offload: the denoiser's blocks stream to the device `offload_blocks` at a
            time (diffusers group offloading; on a separate CUDA stream when the device has
            one and ``offload_blocks == 1``).
        offload_blocks: denoiser blocks per group with ``layerwise_offload`` (>= 1).
        enable_sleep_mode: pack each component's weights into one block at load (the sleep
            pool, as vLLM's flag of this name), so `DiffusionEngine.sleep` returns exactly
            their memory; sleep works without it, returning what the allocator can give back
            (see `diffserve.memory.sleep`).
        max_memory: memory budget of the device for memory-aware admission, in bytes (an int,
            or a string such as ``"24GiB"`` / ``"512MB"``), ``"auto"`` (the device's free
            memory at startup plus what the engine holds), or None (admission by rows only).
            Requests are admitted only while resident weights + the estimated memory of every
            running request stay within it; a request that alone exceeds it is refused (see
            `diffserve.engine.memory_budget`).
        loras: LoRA adapters loaded at startup, ``{name: path}`` (any format diffusers reads:
            see `diffserve.lora.reading`).
        lora_dir: a folder whose ``NAME.safetensors`` files and ``NAME/`` folders load the first
            time a request names ``NAME`` (beside the steps; the request waits in the queue);
            the only place ``POST /v1/loras`` may load from. None = none.
        max_loras: device slots for LoRA adapters: the most distinct adapters the running
            requests may use at once (a request needing another waits), and per request.
        max_lora_rank: the largest adapter rank accepted (slots are padded to it).
        max_cpu_loras: adapters kept in host memory (least recently used ones no request holds
            are dropped beyond it and reload from their path when named again); None = 4 x
            ``max_loras``.
        quantization: quantized weights through torchao, applied after load and before
            compile and offload: None (off), one method for every denoiser and text encoder
            (``"int8_weight_only"``, ``"int8_dynamic"``; on CUDA also ``"float8"``,
            ``"int4_weight_only"``), or a per-component mapping such as ``{"transformer":
            "int8_dynamic", "text_encoder": "int8_weight_only", "vae": None}`` (see
            `diffserve.core.quantization`). Components of a pre-quantized folder (saved by
            diffusers / transformers with a torchao ``quantization_config``) load quantized
            without it.
        quantization_skip: linear layers kept in full precision: ``"auto"`` (the fewest layers
            that keep the denoiser's output error within ``quantization_error_budget``,
            measured at load on calibration prompts; `diffserve.quantization.skip_search`),
            layer-name patterns (a list or a comma-separated string, wildcards ``*``), or None.
        quantization_error_budget: the automatic skip list's bound on the denoiser output's
            relative L2 error (a fraction).
        transformer_file: a GGUF single-file transformer (``*.gguf``) loaded instead of the
            folder's denoiser weights through diffusers' GGUF support (dequantized on the fly);
            the folder gives its config and every other component.
    """

    model: str | None = None
    download_dir: str | None = None
    variant: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "default"
    custom_pipeline: str | None = None
    max_batch_size: int = 16
    max_waiting_requests: int = 1024
    execution_mode: str = "step"
    scheduling_policy: str = "fcfs"
    mixed_sizes: bool = True
    length_groups: bool = True
    aging_s: float = 60.0
    max_padding_ratio: float | str = 1.0
    admission: str = "all"
    default_seed: int | None = None
    max_num_inference_steps: int = 200
    max_pixels: int = 2048 * 2048
    max_num_images_per_prompt: int = 10
    max_num_frames: int = 1025
    max_num_chunks: int = 1024
    num_threads: int | None = None
    prompt_embed_cache_size: int = 256
    prompt_embed_cache_bytes: int = 256 << 20
    overlap_stages: bool = True
    cache_backend: str = "none"
    cache_config: dict = field(default_factory=dict)
    compile: bool = False
    compile_vae: bool = False
    cuda_graphs: bool = False
    cfg_parallel_size: int = 1
    ulysses_degree: int = 1
    executor: str = "auto"
    context_folding: bool = True
    cpu_offload: bool = False
    layerwise_offload: bool = False
    offload_blocks: int = 1
    enable_sleep_mode: bool = False
    max_memory: int | str | None = None
    loras: dict[str, str] = field(default_factory=dict)
    lora_dir: str | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    quantization: str | dict | None = None
    quantization_skip: str | list | None = None
    quantization_error_budget: float = DEFAULT_ERROR_BUDGET
    transformer_file: str | None = None
    #: the resolved model folder (`model_path`), carried to worker processes once resolved
    _model_path: Path | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.execution_mode not in EXECUTION_MODES:
            raise InvalidRequestError("execution_mode", self.execution_mode, f"one of {EXECUTION_MODES}")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidRequestError("load_format", self.load_format, f"one of {LOAD_FORMATS}")
        if self.custom_pipeline is not None and (not isinstance(self.custom_pipeline, str)
                                                 or ":" not in self.custom_pipeline):
            raise InvalidRequestError("custom_pipeline", self.custom_pipeline, "'package.module:ClassName' or None")
        if self.load_format == "custom_pipeline" and self.custom_pipeline is None:
            raise InvalidRequestError("custom_pipeline", None, "set when load_format is custom_pipeline")
        for name in ("max_batch_size", "max_waiting_requests", "max_num_inference_steps",
                     "max_pixels", "max_num_images_per_prompt", "max_num_frames", "max_num_chunks",
                     "cfg_parallel_size", "ulysses_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(name, value, "an integer >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError("scheduling_policy", self.scheduling_policy, f"one of {SCHEDULING_POLICIES}")
        if self.admission not in ADMISSION_MODES:
            raise InvalidRequestError("admission", self.admission, f"one of {ADMISSION_MODES}")
        if isinstance(self.aging_s, bool) or not isinstance(self.aging_s, (int, float)) \
                or not math.isfinite(self.aging_s) or self.aging_s <= 0:
            raise InvalidRequestError("aging_s", self.aging_s, "a positive finite number of seconds")
        if self.max_padding_ratio != "auto" and (
                isinstance(self.max_padding_ratio, bool) or not isinstance(self.max_padding_ratio, (int, float))
                or not 0 <= self.max_padding_ratio <= 1):
            raise InvalidRequestError("max_padding_ratio", self.max_padding_ratio,
                                      "a number in [0, 1] (1 = no cap) or 'auto'")
        if self.executor not in EXECUTORS:
            raise InvalidRequestError("executor", self.executor, f"one of {EXECUTORS}")
        if self.executor == "inprocess" and self.world_size > 1:
            raise InvalidRequestError("executor", self.executor, "multiprocess or auto when cfg_parallel_size x "
                                      "ulysses_degree > 1")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise InvalidRequestError("model", self.model, "a path to a local diffusers folder, a built-in model "
                                      "name (digits, digits-video, digits-reasoning), a Hugging Face Hub id (ORG/NAME[@REVISION]), "
                                      "or None")
        for name in ("download_dir", "variant"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise InvalidRequestError(name, value, "a non-empty string, or None")
        if self.num_threads is not None and (not isinstance(self.num_threads, int)
                                             or isinstance(self.num_threads, bool) or self.num_threads < 1):
            raise InvalidRequestError("num_threads", self.num_threads, "an integer >= 1, or None")
        if self.default_seed is not None and (not isinstance(self.default_seed, int)
                                              or isinstance(self.default_seed, bool)
                                              or not 0 <= self.default_seed <= MAX_SEED):
            raise InvalidRequestError("default_seed", self.default_seed, f"an integer in [0, {MAX_SEED}], or None")
        self.torch_device  # validates `device`
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequestError("dtype", self.dtype, f"auto or one of {sorted(_DTYPES)}")
        size = self.prompt_embed_cache_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequestError("prompt_embed_cache_size", size, "an integer >= 0 (0 = off)")
        nbytes = self.prompt_embed_cache_bytes
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1:
            raise InvalidRequestError("prompt_embed_cache_bytes", nbytes, "an integer >= 1 (bytes)")
        for name in ("compile", "compile_vae", "context_folding", "mixed_sizes", "length_groups", "overlap_stages", "cuda_graphs",
                     "cpu_offload",
                     "layerwise_offload", "enable_sleep_mode"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, getattr(self, name), "true or false")
        if self.compile_vae and not self.compile:
            raise InvalidRequestError("compile_vae", True, "false unless compile is true")
        parse_cache_config(self.cache_backend, self.cache_config)
        blocks = self.offload_blocks
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
            raise InvalidRequestError("offload_blocks", blocks, "an integer >= 1 (denoiser blocks per group)")
        if blocks != 1 and not self.layerwise_offload:
            raise InvalidRequestError("offload_blocks", blocks, "1 unless layerwise_offload is true")
        from diffserve.core.memory_size import parse_memory

        parse_memory(self.max_memory)  # validates `max_memory`
        self._check_loras()
        self._check_quantization()

    def _check_loras(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(name, value, "an integer >= 1")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras):
            raise InvalidRequestError("max_cpu_loras", cpu, f"an integer >= max_loras ({self.max_loras}), or None")
        if not isinstance(self.loras, dict):
            raise InvalidRequestError("loras", self.loras, "a mapping of LoRA names to paths")
        for name, path in self.loras.items():
            if not isinstance(name, str) or not name or not isinstance(path, (str, os.PathLike)):
                raise InvalidRequestError("loras", {name: path}, "a mapping of LoRA names to paths")
        if self.lora_dir is not None and not Path(self.lora_dir).is_dir():
            raise InvalidRequestError("lora_dir", self.lora_dir, "an existing folder")

    @property
    def cpu_lora_capacity(self) -> int:
        """Adapters kept in host memory (`max_cpu_loras`, default 4 x `max_loras`)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras

    @property
    def quantization_spec(self) -> QuantizationSpec:
        """`quantization`, `quantization_skip`, `quantization_error_budget` and
        `transformer_file`, parsed."""
        return QuantizationSpec.parse(self.quantization, self.quantization_skip, self.quantization_error_budget,
                                      self.transformer_file)

    def _check_quantization(self) -> None:
        """Parse the quantization settings and refuse, at start, what cannot run here.

        Raises:
            InvalidRequestError: see `QuantizationSpec.parse` and `check_device`; a GGUF file
                with ``load_format="dummy"`` (nothing would read it); ``int4_weight_only`` with
                offload (its tile-packed weights are made for the device they are packed on).
        """
        spec = self.quantization_spec
        device = self.torch_device
        capability = None
        if device.type == "cuda":
            import torch

            capability = tuple(torch.cuda.get_device_capability(device))
        check_device(spec, device.type, str(self.torch_dtype).removeprefix("torch."), capability)
        if spec.transformer_file is not None and self.load_format == "dummy":
            raise InvalidRequestError("transformer_file", spec.transformer_file,
                                      "unset with load_format dummy (dummy weights read no file)")
        if "int4_weight_only" in spec.enabled_methods() and (self.cpu_offload or self.layerwise_offload):
            raise InvalidRequestError("quantization", "int4_weight_only", "another method with cpu_offload or "
                                      "layerwise_offload (int4's tile-packed weights are made for the device they "
                                      "are packed on)")

    @property
    def world_size(self) -> int:
        """Worker ranks: cfg_parallel_size x ulysses_degree."""
        return self.cfg_parallel_size * self.ulysses_degree

    @property
    def uses_worker_processes(self) -> bool:
        """Whether the model runs in worker processes (`diffserve.executor.multiproc`): asked
        for with ``executor="multiprocess"``, or ``"auto"`` with more than one rank."""
        return self.executor == "multiprocess" or (self.executor == "auto" and self.world_size > 1)

    @property
    def connector_kind(self) -> str:
        """The connector a multi-stage model's stages use (`diffserve.connector.CONNECTORS`):
        ``"shared_memory"`` when they run in separate processes (worker processes: the AR stage
        then has its own), else ``"inprocess"`` (no copy)."""
        return "shared_memory" if self.uses_worker_processes else "inprocess"

    @property
    def model_path(self) -> Path:
        """The model folder to load: `model` resolved by `diffserve.models.resolve_model` (the
        built-in default when None, a built-in model's folder for its name, a Hub id's snapshot
        folder, fetched the first time it is asked for; later calls reuse that folder).

        Raises:
            UnsupportedModelError: a Hub id that cannot be fetched.
        """
        if self._model_path is None:
            from diffserve.models import resolve_model

            self._model_path = resolve_model(self.model, self.download_dir, self.variant)
        return self._model_path

    @property
    def torch_device(self) -> "torch.device":
        """Resolved device (``auto`` -> cuda if available, else cpu)."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        allowed = "auto, cpu, cuda or cuda:N"
        if not isinstance(self.device, str):
            raise InvalidRequestError("device", self.device, allowed)
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise InvalidRequestError("device", self.device, allowed) from exc
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise InvalidRequestError("device", self.device, "auto or cpu (no CUDA device is available)")
            if device.index is not None and device.index >= count:
                raise InvalidRequestError("device", self.device, f"cuda:0 .. cuda:{count - 1}")
        elif device.type != "cpu":
            raise InvalidRequestError("device", self.device, allowed)
        return device

    @property
    def torch_dtype(self) -> "torch.dtype":
        """Resolved dtype (``auto`` -> bf16 on cuda, fp32 on cpu)."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.dtype])

    @property
    def limits(self) -> RequestLimits:
        """Per-request limits derived from this config."""
        return RequestLimits(
            max_num_inference_steps=self.max_num_inference_steps,
            max_pixels=self.max_pixels,
            max_num_images_per_prompt=self.max_num_images_per_prompt,
            max_num_frames=self.max_num_frames,
            max_num_chunks=self.max_num_chunks,
        )


@dataclass(frozen=True)
class TeaCacheConfig:
    """``EngineConfig.cache_config`` of the ``teacache`` backend.

    Attributes:
        rel_l1_thresh: skip while the accumulated rescaled relative L1 distance stays below
            this (>= 0; 0 never skips); None = the model's default.
        coefficients: rescaling polynomial, highest degree first; None = the model's.
        warmup_steps: leading steps that always compute (>= 1: the first step has no cache);
            levels set their own (`diffserve.acceleration.cache_quality.CacheLevel`).
        cache_quality: the quality level of requests that set no ``cache_quality`` (one of
            ``CACHE_QUALITY_LEVELS``). None: ``"balanced"``, unless ``rel_l1_thresh`` is given,
            which keeps plain TeaCache (reuse of the last residual, no guard) with that
            threshold as the default.
        levels: overrides of the quality levels' fields, ``{level: {field: value}}`` (fields
            of `diffserve.acceleration.cache_quality.CacheLevel`; ``"budget": null`` turns the
            guard off), over the model folder's and the defaults; checked when the backend
            is built.
        record_changes: record, for every step of a ``max``-level request (all steps
            computed) after its first, the relative L1 change of the modulated input and of
            the denoiser output (the points TeaCache's coefficients are fitted on: ``diffserve
            calibrate-cache``), reported in the backend's stats (``changes``). Off in serving:
            it reads two floats back from the device per request and step.
    """

    rel_l1_thresh: float | None = None
    coefficients: tuple[float, ...] | None = None
    warmup_steps: int = 1
    cache_quality: str | None = None
    levels: dict[str, Any] | None = None
    record_changes: bool = False

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "TeaCacheConfig":
        """Validate a ``cache_config`` dict.

        Raises:
            InvalidRequestError: unknown key or a value out of range.
        """
        allowed = {"rel_l1_thresh", "coefficients", "warmup_steps", "cache_quality", "levels", "record_changes"}
        for key in options:
            if key not in allowed:
                raise InvalidRequestError("cache_config", key, f"a teacache key, one of {sorted(allowed)}")
        thresh = options.get("rel_l1_thresh")
        if thresh is not None and (isinstance(thresh, bool) or not isinstance(thresh, (int, float))
                                   or not math.isfinite(thresh) or thresh < 0):
            raise InvalidRequestError("cache_config.rel_l1_thresh", thresh, "a finite number >= 0")
        coefficients = options.get("coefficients")
        if coefficients is not None:
            if (not isinstance(coefficients, (list, tuple)) or not coefficients
                    or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                               and math.isfinite(c) for c in coefficients)):
                raise InvalidRequestError("cache_config.coefficients", coefficients,
                                          "a non-empty list of finite numbers (highest degree first)")
            coefficients = tuple(float(c) for c in coefficients)
        warmup = options.get("warmup_steps", 1)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise InvalidRequestError("cache_config.warmup_steps", warmup, "an integer >= 1")
        quality = options.get("cache_quality")
        if quality is not None and quality not in CACHE_QUALITY_LEVELS:
            raise InvalidRequestError("cache_config.cache_quality", quality, f"one of {', '.join(CACHE_QUALITY_LEVELS)}")
        levels = options.get("levels")
        if levels is not None and not isinstance(levels, dict):
            raise InvalidRequestError("cache_config.levels", levels, "an object {level: {field: value}}")
        record = options.get("record_changes", False)
        if not isinstance(record, bool):
            raise InvalidRequestError("cache_config.record_changes", record, "true or false")
        return cls(None if thresh is None else float(thresh), coefficients, warmup, quality, levels, record)


@dataclass(frozen=True)
class CacheDiTConfig:
    """``EngineConfig.cache_config`` of the ``cache_dit`` backend (cache-dit's DBCacheConfig
    names; defaults are cache-dit 1.5.3's).

    Attributes:
        Fn_compute_blocks: leading blocks always computed (>= 1); None = min(8, blocks - 1 -
            Bn_compute_blocks). Fn + Bn must be below the number of blocks (of each block list,
            for models whose blocks are cached as several lists, e.g. Flux's double and single
            blocks).
        Bn_compute_blocks: trailing blocks always computed (>= 0).
        residual_diff_threshold: reuse the cache while the Fn residual's relative L1 change
            is below this (>= 0; 0 never reuses).
        max_warmup_steps: leading steps that always compute (>= 0).
        warmup_interval: compute every this many steps during warm-up (>= 1).
        max_cached_steps: most reused steps per request (-1 = no limit).
        max_continuous_cached_steps: most consecutive reused steps (-1 = no limit).
        taylorseer: extrapolate the cached residual with TaylorSeer.
        taylorseer_order: Taylor expansion order (>= 1).
    """

    Fn_compute_blocks: int | None = None
    Bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.08
    max_warmup_steps: int = 8
    warmup_interval: int = 1
    max_cached_steps: int = -1
    max_continuous_cached_steps: int = -1
    taylorseer: bool = False
    taylorseer_order: int = 1

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "CacheDiTConfig":
        """Validate a ``cache_config`` dict.

        Raises:
            InvalidRequestError: unknown key or a value out of range.
        """
        lows = {"Fn_compute_blocks": 1, "Bn_compute_blocks": 0, "max_warmup_steps": 0,
                "warmup_interval": 1, "max_cached_steps": -1, "max_continuous_cached_steps": -1,
                "taylorseer_order": 1}
        allowed = set(lows) | {"residual_diff_threshold", "taylorseer"}
        for key, value in options.items():
            if key not in allowed:
                raise InvalidRequestError("cache_config", key, f"a cache_dit key, one of {sorted(allowed)}")
            if key in lows and (isinstance(value, bool) or not isinstance(value, int) or value < lows[key]):
                if not (key == "Fn_compute_blocks" and value is None):
                    raise InvalidRequestError(f"cache_config.{key}", value, f"an integer >= {lows[key]}")
        thresh = options.get("residual_diff_threshold", 0.08)
        if isinstance(thresh, bool) or not isinstance(thresh, (int, float)) or not math.isfinite(thresh) \
                or thresh < 0:
            raise InvalidRequestError("cache_config.residual_diff_threshold", thresh, "a finite number >= 0")
        if not isinstance(options.get("taylorseer", False), bool):
            raise InvalidRequestError("cache_config.taylorseer", options["taylorseer"], "true or false")
        return cls(**{**options, "residual_diff_threshold": float(thresh)})


#: Values of ``EngineConfig.cache_backend``.
CACHE_BACKENDS = ("none", "teacache", "cache_dit")


def parse_cache_config(backend: str, options: Any):
    """Validate ``EngineConfig.cache_backend`` and ``cache_config``.

    Returns:
        None for ``none`` (which takes no options), else the backend's typed config
        (`TeaCacheConfig` or `CacheDiTConfig`).

    Raises:
        InvalidRequestError: unknown backend, options not a dict, unknown key, bad value.
    """
    if backend not in CACHE_BACKENDS:
        raise InvalidRequestError("cache_backend", backend, f"one of {', '.join(CACHE_BACKENDS)}")
    if not isinstance(options, dict):
        raise InvalidRequestError("cache_config", options, "a JSON object / dict of backend options")
    if backend == "teacache":
        return TeaCacheConfig.from_dict(options)
    if backend == "cache_dit":
        return CacheDiTConfig.from_dict(options)
    if options:
        raise InvalidRequestError("cache_config", options, "empty when cache_backend is none")
    return None
