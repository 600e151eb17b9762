"""The engine client: everything an entrypoint may call on an engine (vLLM's
``vllm/engine/protocol.py``), and the one module of `diffserve.engine` the entrypoints import
(the import-linter contract ``entrypoints-via-engine-client``).

`EngineClient` is what the CLI, the OpenAI server, its services and ops routes, and the Ray
Serve replicas use: the model's facts, the request plan and limits (through the shared
`InputProcessor`), counts of waiting and running requests, stats, sleep mode, and adding,
aborting and following requests (and a stream's interactions), and LoRA adapters. `DiffusionEngine` (offline,
synchronous) and `AsyncDiffusionEngine` (its loop in a thread, asyncio streams) both implement
it; they differ only in `generate`: the synchronous one blocks and returns the outputs of a
list of prompts, the asynchronous one is an async iterator of one request's events. Nothing
else of the engine (its request scheduler, executor, runner or private state) is an
entrypoint's business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from diffserve.config import EngineConfig
from diffserve.core.messages import ModelInfo
from diffserve.core.outputs import StreamEvent
from diffserve.core.sampling_params import ModelSpec, SamplingParams
from diffserve.engine.async_engine import AsyncDiffusionEngine
from diffserve.engine.engine import DiffusionEngine
# the interaction limits, for request schemas that state them
from diffserve.engine.input_processor import MAX_EVENT_ID_CHARS, MAX_TRANSITION_CHUNKS, InputProcessor, ProcessedRequest

__all__ = ["AsyncDiffusionEngine", "DiffusionEngine", "EngineClient", "InputProcessor", "MAX_EVENT_ID_CHARS",
           "MAX_TRANSITION_CHUNKS", "ProcessedRequest"]


@runtime_checkable
class EngineClient(Protocol):
    """What an entrypoint may call on an engine (see the module docstring).

    Attributes:
        config: the engine's `EngineConfig` (limits, queue bound, default seed, model folder).
        model_info: the loaded model: `ModelSpec`, pipeline class, step batching, chunk
            streaming.
        input_processor: builds `ProcessedRequest` s (seeds, parameters, inputs, plans; one
            for every entrypoint).
        error: why the engine can no longer run, or None while healthy.
    """

    config: EngineConfig
    model_info: ModelInfo
    input_processor: InputProcessor
    error: str | None

    # ------------------------------------------------------------------ model and health
    @property
    def spec(self) -> ModelSpec:
        """The loaded model's defaults and limits."""

    @property
    def is_running(self) -> bool:
        """The engine can run requests (its loop and workers are alive)."""

    # ------------------------------------------------------------------ counts and stats
    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""

    @property
    def num_running(self) -> int:
        """Admitted requests (being prepared, denoising, between chunks or being decoded)."""

    @property
    def num_running_rows(self) -> int:
        """Denoiser rows held by running requests (guidance branches count)."""

    def queue_position(self, request_id: str) -> int | None:
        """A waiting request's 1-based place in the queue; None when not waiting."""

    def stats(self) -> dict[str, Any]:
        """Acceleration counters, non-finite outputs, workers alive, offload, memory budget
        and sleep level."""

    def add_step_listener(self, listener: Callable[[int, int, float], None]) -> None:
        """Call ``listener(num_rows, num_requests, seconds)`` after every denoising step."""

    # ------------------------------------------------------------------ sleep mode
    @property
    def is_sleeping(self) -> bool:
        """The weights are off the device or discarded."""

    @property
    def sleep_state(self) -> str:
        """``"awake"``, ``"draining"`` or ``"asleep"``."""

    @property
    def sleep_level(self) -> int | None:
        """1 or 2 while asleep, None while awake."""

    def sleep(self, level: int = 1) -> None:
        """Stop admitting, let running requests finish, put the weights to sleep (blocks)."""

    def wake_up(self) -> None:
        """Restore the weights and admit again (blocks)."""

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | ProcessedRequest, params: SamplingParams | None = None,
                    request_id: str | None = None, preview_steps: Sequence[int] = (), inputs: Any = None,
                    listener: Callable[[StreamEvent], None] | None = None, progress: bool = True) -> str:
        """Queue a request (a prompt, or a `ProcessedRequest`); returns its id."""

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request; False if unknown or ended."""

    def submit_interaction(self, request_id: str, interaction: Mapping[str, Any]) -> str:
        """Change a running stream's prompt from its next chunk on; returns the event id."""

    # ------------------------------------------------------------------ LoRA adapters
    def check_loras(self, loras: Mapping[str, float] | None) -> None:
        """Check a request's adapter names (an adapter not held starts loading)."""

    def load_lora(self, name: str, path: Any, origin: str = "api", within_lora_dir: bool = False) -> dict[str, Any]:
        """Load a LoRA adapter (blocks until every worker holds it); its listing entry."""

    def unload_lora(self, name: str) -> None:
        """Drop a LoRA adapter no request uses."""

    def list_loras(self) -> list[dict[str, Any]]:
        """Every registered LoRA adapter, with its state and use count."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Generate: `DiffusionEngine.generate` blocks and returns the outputs of a list of
        prompts; `AsyncDiffusionEngine.generate` is an async iterator of one request's
        events."""
