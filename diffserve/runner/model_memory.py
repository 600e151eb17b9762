"""`ModelMemory`: the memory side of one loaded model, owned by its `ModelRunner`.

It places the weights (`diffserve.memory.offload`: model CPU offload, layerwise offload,
or everything on the device), puts them to sleep and wakes them (`diffserve.memory.sleep`),
measures the model's memory profile for admission (`diffserve.memory.profile`) and
turns a step's measured peak into the step's own peak above the resident model
(`diffserve.memory.accounting`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch

from diffserve.memory.offload import OffloadManager, weights_device
from diffserve.memory.accounting import STEP_RESET_INTERVAL_S, PeakWindow, release_host_memory, rss_bytes
from diffserve.core.sleep_levels import check_level
from diffserve.memory.sleep import WeightSleeper

if TYPE_CHECKING:
    from diffserve.quantization.plan import QuantizationPlan
    from diffserve.acceleration.prompt_embed_cache import PromptEmbedCache
    from diffserve.config import EngineConfig
    from diffserve.core.messages import MemoryProfile
    from diffserve.pipelines.base import PipelineAdapter


class ModelMemory:
    """Weights placement, sleep mode, memory profile and per-step peaks of one model.

    Args:
        adapter: the loaded adapter.
        config: ``cpu_offload``, ``layerwise_offload``, ``offload_blocks``,
            ``enable_sleep_mode`` and, for level-2 wake, the model folder and load format.
        device: the compute device.
        denoising: says whether any request still has denoising steps to run.
        quantization: what was quantized at load, quantized again the same way when a level-2
            wake reloads the weights from the folder.

    Call `ready` once the rest of the runner is set up (after compile warm-up).
    """

    def __init__(self, adapter: "PipelineAdapter", config: "EngineConfig", device: torch.device,
                 denoising: Callable[[], bool], quantization: "QuantizationPlan | None" = None):
        self.adapter = adapter
        self.config = config
        self.quantization = quantization
        self.device = device
        self.offload = OffloadManager(adapter, device, config.cpu_offload, config.layerwise_offload,
                                      config.offload_blocks)
        self.offload.set_denoising(denoising)
        self.sleeper = WeightSleeper(adapter.modules, self._reload_components, device,
                                     pool=self.offload.fixed_components if config.enable_sleep_mode else None)
        self._profile: "MemoryProfile | None" = None
        self._idle_baseline: int | None = None
        self._read_batch: Hashable = None  # the batch of the last step whose peak was read (CPU)
        self._last_step_peak: int | None = None

    def ready(self) -> None:
        """Pack the sleep pool (``enable_sleep_mode``) and record what the idle engine holds:
        the resident weights on CUDA, the trimmed process RSS on CPU (per-step peaks are
        reported above it)."""
        self.sleeper.pack()
        if self.device.type == "cuda":
            self._idle_baseline = self.offload.resident_weight_bytes()
        else:
            release_host_memory()
            self._idle_baseline = rss_bytes()

    # ------------------------------------------------------------------ per-step peaks
    def window(self, batch: Hashable = None) -> PeakWindow:
        """A peak-measurement window for one denoising step. On CPU it resets the RSS
        high-water mark at most every `STEP_RESET_INTERVAL_S` (see `diffserve.memory.accounting`)
        and reads it only when it reset it or the step's `batch` (any value naming the batch's
        composition; None = always read) differs from the last read step's: the steps of an
        unchanged batch between two resets report the last read peak (`step_peak`)."""
        read = self.device.type == "cuda" or batch is None or batch != self._read_batch
        return PeakWindow(self.device, min_reset_interval_s=STEP_RESET_INTERVAL_S, read=read)

    def step_peak(self, window: PeakWindow, batch: Hashable = None) -> int | None:
        """The step's peak above the resident model, bytes: on CUDA the allocator peak minus
        the weights on the device; on CPU the RSS high-water mark minus the idle engine's RSS
        (the last read one when `window` skipped its read). None when not measurable."""
        if window.skipped:
            return self._last_step_peak
        if window.peak is None:
            return None
        baseline = self.offload.resident_weight_bytes() if self.device.type == "cuda" else self._idle_baseline
        self._last_step_peak = max(0, window.peak - (baseline or 0))
        self._read_batch = batch
        return self._last_step_peak

    # ------------------------------------------------------------------ admission
    def profile(self, limits) -> "MemoryProfile":
        """The `MemoryProfile`, measured on first call (while no request runs)."""
        if self._profile is None:
            from diffserve.memory.profile import measure_memory_profile

            self._profile = measure_memory_profile(self.adapter, self.offload, limits, self.device)
        return self._profile

    # ------------------------------------------------------------------ sleep mode
    @property
    def sleep_level(self) -> int | None:
        """1 or 2 while asleep, None while awake."""
        return self.sleeper.level

    def sleep(self, level: int, held: int, prompt_cache: "PromptEmbedCache | None") -> None:
        """Level 1 moves the weights off the device, level 2 discards them; both drop the
        prompt-embedding cache (see `diffserve.memory.sleep`).

        Args:
            held: requests the runner still holds (must be 0).

        Raises:
            InvalidRequestError: `level` is not 1 or 2.
            RuntimeError: requests are still held.
        """
        level = check_level(level)
        if held:
            raise RuntimeError(f"cannot sleep with {held} requests in the runner")
        if prompt_cache is not None:
            prompt_cache.clear()
        if self.sleeper.level is None:
            self.offload.detach()
        self.sleeper.sleep(level)

    def wake_up(self) -> None:
        """Restore the weights (reloaded from the model folder after level 2) and their
        placement; no-op while awake."""
        if self.sleeper.level is None:
            return
        self.sleeper.wake_up()
        self.offload.attach()

    def _reload_components(self) -> dict[str, Any]:
        """The folder's components loaded (and quantized) again as at startup (level-2 wake)."""
        from diffserve.runner.loader import load_components

        config = self.config
        load_format = "default" if config.load_format == "custom_pipeline" else config.load_format
        components = load_components(config.model_path, config.torch_dtype, load_format,
                                     device=weights_device(config), variant=config.variant,
                                     transformer_file=config.transformer_file)[1]
        if self.quantization is not None:
            from diffserve.quantization.plan import apply_plan

            apply_plan(components, self.quantization, config.torch_dtype)
        return components

    def stats(self) -> dict[str, Any]:
        """`OffloadManager.stats` plus ``sleeping`` (the sleep level, or None)."""
        return {**self.offload.stats(), "sleeping": self.sleeper.level}
