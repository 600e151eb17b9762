"""`ModelRunner`: how a step runs. Loads the model, runs prepare / one batched denoising step /
decode under `torch.inference_mode()`, and isolates a failing request from the rest of its
batch."""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from diffserve.acceleration.accelerator import Accelerator
from diffserve.config import EngineConfig
from diffserve.pipelines.base import PipelineAdapter, RequestState
from diffserve.runner.loader import load_adapter
from diffserve.runner.step_batch import StepBatch
from diffserve.sampling_params import ModelSpec, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Outcome of one denoising step over a batch.

    Attributes:
        num_rows: transformer rows in the forward (all requests, CFG rows included).
        failures: request_id -> the exception that request raised; requests not listed took
            their step.
    """

    num_rows: int
    failures: dict[str, BaseException] = field(default_factory=dict)


class ModelRunner:
    """Runs the pipeline adapter of one loaded model on one device.

    Args:
        config: engine configuration (model folder, device, dtype, load format, threads,
            acceleration: prompt-embedding cache, cache backend, compile).

    Raises:
        UnsupportedModelError: the folder is not a diffusers folder or its pipeline class
            has no adapter.
        InvalidRequestError: the configured cache backend does not support this model.
    """

    def __init__(self, config: EngineConfig, adapter: PipelineAdapter | None = None):
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        self.adapter = adapter or load_adapter(
            config.model_path, self.device, config.torch_dtype, config.load_format
        )
        self.accelerator = Accelerator(self.adapter, config)

    @property
    def spec(self) -> ModelSpec:
        """The loaded model's resolution factor, defaults and limits."""
        return self.adapter.spec

    def batch_key(self, params: SamplingParams) -> Hashable:
        """Batch key of a request with resolved `params` (equal keys can share a step)."""
        return self.adapter.batch_key(params)

    def prompt_is_truncated(self, prompt: str) -> bool:
        """Whether `prompt` exceeds the text encoder's token limit (engine thread only)."""
        return self.adapter.prompt_is_truncated(prompt)

    @torch.inference_mode()
    def prepare(self, state: RequestState) -> None:
        """Encode the prompt and create the request's latents, scheduler and timesteps; start
        the request's caching state from scratch."""
        self.adapter.prepare(state)
        self.accelerator.reset(state)

    @torch.inference_mode()
    def execute_step(self, states: list[RequestState]) -> StepResult:
        """Run ONE denoising step for `states` (same batch key) in one denoiser forward.

        If the batched forward raises, each request is retried alone so only the ones that
        fail on their own are reported; a failing diffusion-scheduler step fails only its
        own request. A cache backend that cannot share forwards (cache_dit) gets one forward
        per request.
        """
        if len(states) > 1 and not self.accelerator.shares_forward:
            return self._execute_alone(states)
        try:
            batch = StepBatch.gather(self.adapter, states)
            rows = batch.scatter(self.accelerator.denoise(batch))
        except Exception as exc:  # noqa: BLE001 - isolate per request
            if len(states) == 1:
                return StepResult(num_rows=states[0].rows, failures={states[0].request_id: exc})
            logger.warning("batched step failed (%s); retrying %d requests alone", exc, len(states))
            return self._execute_alone(states)
        result = StepResult(num_rows=batch.num_rows)
        for state, noise_pred in zip(states, rows):
            try:
                self.adapter.step(state, noise_pred)
            except Exception as exc:  # noqa: BLE001
                result.failures[state.request_id] = exc
        return result

    def _execute_alone(self, states: list[RequestState]) -> StepResult:
        """One `execute_step` per request; num_rows is the largest forward's."""
        result = StepResult(num_rows=0)
        for state in states:
            single = self.execute_step([state])
            result.num_rows = max(result.num_rows, single.num_rows)
            result.failures.update(single.failures)
        return result

    def acceleration_stats(self) -> dict[str, Any]:
        """Prompt-embedding cache, cache backend and compile counters (see
        `diffserve.acceleration.accelerator.Accelerator.stats`)."""
        return self.accelerator.stats()

    @torch.inference_mode()
    def decode(self, state: RequestState, latents: torch.Tensor | None = None) -> Any:
        """Decode the request's latents (or `latents`) into its output type."""
        return self.adapter.decode(state, latents)

    def peak_memory_bytes(self) -> int:
        """CUDA allocator peak (bytes) on GPU; process peak RSS (bytes) on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
