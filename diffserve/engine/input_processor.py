"""`InputProcessor`: what a request becomes before it is queued, in one place for every
entrypoint (vLLM's input processor): the offline API, the CLI and every HTTP route (images,
edits, videos, video streams) hand it a prompt, `SamplingParams` and input images, and get back
`ProcessedRequest` s the engine queues as they are.

For each request it
- checks the prompt against the model (`validate_prompt`) and normalises the input images
  (`diffserve.core.inputs.make_inputs`);
- chooses the seeds: a group of ``n`` outputs of one prompt is ``n`` requests, output ``i``
  with seed ``(seed + i) mod 2**63``, where ``seed`` is the request's own, else the engine's
  ``default_seed``, else drawn at random in ``[0, 2**31)``: each output reproduces alone from
  its seed;
- resolves the parameters (the model's defaults and limits, the engine's request limits;
  `SamplingParams.resolve`), optionally sizing an edit like its first input image
  (`diffserve.core.inputs.auto_size`);
- plans it with the workers (`RequestPlan`: denoiser rows, batch key, the steps it will run;
  the family's own rules on images, masks, strength and chunks) and, with ``max_memory``,
  checks it can ever fit (`diffserve.engine.memory_budget`);
- checks a running stream's interactions (`process_interaction`).

Everything a client can get wrong is raised here, before anything is queued, as an
`InvalidRequestError` naming the field.
"""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffserve.core.errors import InvalidRequestError
from diffserve.core.inputs import RequestInputs, auto_size, make_inputs
from diffserve.core.messages import Interaction, RequestPlan
from diffserve.core.sampling_params import MAX_SEED, ModelSpec, RequestLimits, SamplingParams, validate_prompt

if TYPE_CHECKING:
    from diffserve.engine.memory_budget import MemoryBudget

#: Longest ``event_id`` of an interaction, characters.
MAX_EVENT_ID_CHARS = 256
#: Most ``transition_chunks`` of an interaction.
MAX_TRANSITION_CHUNKS = 1024
#: Seeds drawn at random are below this (so they print short and fit any client's int).
RANDOM_SEED_BOUND = 2**31


@dataclass(frozen=True)
class ProcessedRequest:
    """A request checked, resolved and planned by the `InputProcessor`, ready to queue
    (`DiffusionEngine.add_request` takes it as it is).

    Attributes:
        prompt: the checked prompt.
        params: the resolved `SamplingParams` (every default filled, the seed chosen).
        inputs: the input images / mask (`RequestInputs`), or None.
        plan: the workers' `RequestPlan` (rows, batch key, denoising steps it will run).
        memory_bytes: its estimated bytes while running (memory-aware admission; 0 without
            ``max_memory``).
        token_bytes: the part of `memory_bytes` proportional to its image tokens (what
            padding its rows in a mixed-size forward costs per token slot; 0 without
            ``max_memory``).
    """

    prompt: str
    params: SamplingParams
    inputs: RequestInputs | None
    plan: RequestPlan
    memory_bytes: int = 0
    token_bytes: int = 0

    @property
    def seed(self) -> int:
        """The seed it runs with."""
        return self.params.seed

    @property
    def num_steps(self) -> int:
        """The denoising steps it will run (image-to-image: the strength's share)."""
        return self.plan.num_steps


class InputProcessor:
    """Turns prompts, params and inputs into `ProcessedRequest` s (see the module docstring).

    Args:
        spec: the loaded model's `ModelSpec`.
        limits: the engine's `RequestLimits`.
        default_seed: seed of requests that give none (None: drawn at random).
        plan: the workers' planner (`Executor.plan`: resolved params, inputs -> `RequestPlan`;
            raises `InvalidRequestError` for what the family cannot honour). Thread-safe.
        memory_budget: memory-aware admission (None without ``max_memory``).
    """

    def __init__(self, spec: ModelSpec, limits: RequestLimits, default_seed: int | None,
                 plan: Callable[[SamplingParams, RequestInputs | None], RequestPlan],
                 memory_budget: MemoryBudget | None = None):
        self.spec = spec
        self.limits = limits
        self.default_seed = default_seed
        self._plan = plan
        self._memory_budget = memory_budget

    def first_seed(self, seed: int | None) -> int:
        """The seed of a group's first output: `seed` when given, else the engine's default
        seed, else one drawn at random in ``[0, 2**31)``."""
        if seed is not None:
            return seed
        if self.default_seed is not None:
            return self.default_seed
        return secrets.randbelow(RANDOM_SEED_BOUND)

    def process(self, prompt: Any, params: SamplingParams | None = None, inputs: Any = None, n: int = 1,
                size_from_inputs: bool = False) -> list[ProcessedRequest]:
        """`n` requests for one prompt: output ``i`` with seed ``(seed + i) mod 2**63`` (see
        `first_seed`), otherwise the same `params`.

        Args:
            prompt: the prompt (checked against the model).
            params: the request's `SamplingParams` (None: the model's defaults); its
                ``num_images_per_prompt`` images come out of each request.
            inputs: input images / mask (`RequestInputs`, or any form `make_inputs` takes).
            n: requests to make (the HTTP ``n``, the CLI's ``-n``), 1..``max_num_images_per_prompt``.
            size_from_inputs: without a size in `params`, generate at the first input image's
                size rounded to the model's multiple (an edit's ``size="auto"``).

        Returns:
            The `n` requests, in output order.

        Raises:
            InvalidRequestError: naming the field: the prompt, a parameter outside the model's
                or engine's range, an input the model cannot take, `n`, or a request that alone
                exceeds ``max_memory``.
        """
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", params, "a SamplingParams")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.limits.max_num_images_per_prompt:
            raise InvalidRequestError("n", n, f"an integer in [1, {self.limits.max_num_images_per_prompt}]")
        prompt = validate_prompt(prompt, self.spec)
        inputs = make_inputs(inputs) if inputs is not None else None
        if size_from_inputs and inputs is not None and params.width is None and params.height is None:
            width, height = auto_size(inputs.images[0].size, self.spec, self.limits)
            params = dataclasses.replace(params, width=width, height=height)
        first = dataclasses.replace(params, seed=self.first_seed(params.seed)).resolve(self.spec, self.limits)
        requests = []
        for i in range(n):
            resolved = first if i == 0 else dataclasses.replace(first, seed=(first.seed + i) % (MAX_SEED + 1))
            plan = self._plan(resolved, inputs)  # each its own: a whole-request model keys each request apart
            memory = token_bytes = 0
            if self._memory_budget is not None:
                memory = self._memory_budget.check(resolved, plan.rows)
                token_bytes = self._memory_budget.token_bytes(resolved, plan.rows)
            requests.append(ProcessedRequest(prompt, resolved, inputs, plan, memory, token_bytes))
        return requests

    def process_interaction(self, interaction: Mapping[str, Any]) -> Interaction:
        """A running stream's interaction checked: ``{"prompt": str, "transition_chunks": int
        = 0, "event_id": str}`` (the event id is a fresh uuid when absent).

        Raises:
            InvalidRequestError: naming the field: not a mapping, an unknown field, no prompt or
                an invalid one, ``transition_chunks`` outside [0, `MAX_TRANSITION_CHUNKS`], an
                ``event_id`` that is not 1..`MAX_EVENT_ID_CHARS` printable characters.
        """
        if not isinstance(interaction, Mapping):
            raise InvalidRequestError("interaction", interaction, "a mapping with prompt, transition_chunks, event_id")
        unknown = sorted(set(interaction) - {"prompt", "transition_chunks", "event_id"})
        if unknown:
            raise InvalidRequestError(str(unknown[0]), interaction[unknown[0]],
                                      "absent: an interaction takes prompt, transition_chunks and event_id")
        if "prompt" not in interaction:
            raise InvalidRequestError("prompt", None, "a non-empty string (required)")
        prompt = validate_prompt(interaction["prompt"], self.spec)
        k = interaction.get("transition_chunks", 0)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TRANSITION_CHUNKS:
            raise InvalidRequestError("transition_chunks", k, f"an integer in [0, {MAX_TRANSITION_CHUNKS}]")
        event_id = interaction.get("event_id")
        if event_id is None:
            event_id = uuid.uuid4().hex
        elif not isinstance(event_id, str) or not 1 <= len(event_id) <= MAX_EVENT_ID_CHARS \
                or not event_id.isprintable():
            raise InvalidRequestError("event_id", event_id, f"a string of 1 to {MAX_EVENT_ID_CHARS} printable "
                                      "characters")
        return Interaction(prompt=prompt, transition_chunks=int(k), event_id=event_id)
