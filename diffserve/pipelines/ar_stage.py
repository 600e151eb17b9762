"""The model side of an autoregressive (AR) stage: what a family's adapter tells the AR stage
runner (`diffserve.runner.ar_stage`) about its LM / VLM.

A family whose folder has an AR stage (its pipeline class declares one: `digits-reasoning`'s
``language_model``, GLM-Image's ``vision_language_encoder``) gives the runner an `ARStageModel`:

- `ARStageModel.inputs`: a request's prompt and params -> `ARInput` (token ids, or the
  model's full input dict for a VLM; the group of requests that may share one batched
  ``generate``; the new-token budget; the sampling seed);
- either continuous batching (`ARStageModel.continuous_batching`: the runner keeps ONE
  transformers ``ContinuousBatchingManager`` alive and adds requests to it as they come) or
  `ARStageModel.generate`: one batched ``generate`` per group of waiting requests, each row
  sampling from its own seeded generator (`PerRowSampler`), so a request's tokens equal its
  solo run's;
- `ARStageModel.products`: the requests' generated tokens -> their payloads, one per guidance
  branch (`diffserve.connector.payload.Payload`), and the text to return to the user.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from diffserve.connector.payload import Payload
from diffserve.core.sampling_params import SamplingParams


@dataclass
class ARInput:
    """One request's AR work.

    Attributes:
        request_id: the request.
        prompt: its prompt.
        params: its resolved sampling params.
        prompt_ids: the LM's input ids (no padding).
        model_inputs: extra per-request inputs of a VLM's ``generate`` (e.g. GLM-Image's
            ``image_grid_thw``), batched by the stage model itself; None for a plain LM.
        group: requests with equal groups may share one batched ``generate``.
        max_new_tokens: the new-token budget.
        seed: the sampling seed (None: greedy).
    """

    request_id: str
    prompt: str
    params: SamplingParams
    prompt_ids: list[int]
    model_inputs: dict[str, Any] | None = None
    group: Hashable = None
    max_new_tokens: int = 1
    seed: int | None = None


@dataclass
class ARProduct:
    """What the AR stage produced for one request.

    Attributes:
        parts: branch name -> payload (every branch its DiT stage will need).
        text: the AR stage's text for the user (`GenerationOutput.ar_text`), or None.
        num_tokens: tokens generated.
    """

    parts: dict[str, Payload]
    text: str | None = None
    num_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class ARStageModel(ABC):
    """The AR stage's model math for one family (see the module docstring).

    Attributes:
        continuous_batching: whether the runner may drive `language_model` with transformers'
            continuous batching (``init_continuous_batching``); otherwise it calls `generate`.
    """

    continuous_batching: bool = False

    @property
    @abstractmethod
    def language_model(self) -> torch.nn.Module:
        """The transformers causal LM / VLM."""

    @abstractmethod
    def max_context_tokens(self) -> int:
        """The most tokens one request's sequence can hold (prompt and generated), which sizes
        continuous batching's paged cache."""

    def generation_config(self) -> Any:
        """The ``GenerationConfig`` continuous batching runs with (default: the model's own)."""
        return self.language_model.generation_config

    @abstractmethod
    def inputs(self, request_id: str, prompt: str, params: SamplingParams) -> ARInput:
        """The request's AR work.

        Raises:
            InvalidRequestError: the prompt does not fit the LM (named field and limit).
        """

    def generate(self, batch: Sequence[ARInput]) -> list[list[int]]:
        """Batched ``generate`` for requests of one group; returns each request's generated
        ids (EOS included when generated). Default: left-padded ``prompt_ids``, greedy or each
        row sampled with its own seed (`PerRowSampler`)."""
        lm = self.language_model
        config = self.generation_config()
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        longest = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[pad] * (longest - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (longest - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        device = next(lm.parameters()).device
        config, kwargs = generation_setup(config, batch, max(r.max_new_tokens for r in batch))
        out = lm.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                          **kwargs)
        return [cut_at_eos(row, config.eos_token_id)[: r.max_new_tokens] for r, row in zip(batch, out[:, longest:].tolist())]

    def text(self, generated: list[int]) -> str | None:
        """The user-facing text of generated tokens (streamed as they come), None when the AR
        stage writes no text (image tokens). Default: None."""
        return None

    @abstractmethod
    def products(self, batch: Sequence[ARInput], generated: Sequence[list[int]]) -> list[ARProduct | BaseException]:
        """Each request's payloads and text from its generated ids (one result or exception per
        request, so one failure stays its own)."""


def cut_at_eos(tokens: list[int], eos: int | list[int] | None) -> list[int]:
    """`tokens` up to and including the first EOS (all of them when none)."""
    stops = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


class PerRowSampler:
    """A logits processor that samples each row of a batch from its own generator, so batched
    sampling equals each request's solo run (``torch.manual_seed(seed)`` then ``generate(...,
    do_sample=True)``, as diffusers' `GlmImagePipeline` does).

    Runs with ``do_sample=False``: it applies the generation config's sampling warpers
    (temperature, top-k, top-p: transformers' order), draws one token per row with
    ``torch.multinomial(softmax(scores), 1, generator=row's)``, and returns scores that are
    -inf everywhere but at the drawn token, which greedy decoding then picks. Rows whose
    generator is None are left as they are (greedy).

    Args:
        generators: one CPU ``torch.Generator`` (or None) per batch row.
        temperature / top_k / top_p: the generation config's values (None / 1.0 / 0 = off).
    """

    def __init__(self, generators: Sequence[torch.Generator | None], temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None):
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.generators = list(generators)
        self.warpers = []
        if temperature is not None and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        warped = scores
        for warper in self.warpers:
            warped = warper(input_ids, warped)
        probs = torch.softmax(warped, dim=-1)
        out = scores.clone()
        for row, generator in enumerate(self.generators):
            if generator is None:
                continue
            token = torch.multinomial(probs[row:row + 1].cpu(), 1, generator=generator).item()
            out[row].fill_(float("-inf"))
            out[row, token] = 0.0
        return out


def effective_generation_value(config: Any, name: str) -> Any:
    """The value ``generate`` uses for a generation-config field: the config's own, else
    transformers' global default (e.g. ``top_k`` 50 when a model's ``generation_config.json``
    leaves it unset)."""
    value = getattr(config, name, None)
    if value is not None:
        return value
    try:
        defaults = config._get_default_generation_params()
    except AttributeError:  # pragma: no cover - other transformers versions
        defaults = {"top_k": 50, "top_p": 1.0, "temperature": 1.0}
    return defaults.get(name)


def generation_setup(config: Any, batch: Sequence[ARInput], max_new_tokens: int) -> tuple[Any, dict[str, Any]]:
    """The ``generation_config`` and extra ``generate`` keyword arguments of a batch: a copy of
    `config` with `max_new_tokens`, greedy (``do_sample=False``, its sampling warpers unset), and
    when some request samples, a `PerRowSampler` (each sampling row seeded with its request's seed,
    applying `config`'s warpers) as the logits processor.

    Raises:
        ValueError: the config asks for a sampling warper `PerRowSampler` does not implement
            (min_p, typical_p, epsilon / eta cutoff, top_h).
    """
    import copy

    setup = copy.deepcopy(config)
    setup.max_new_tokens = max_new_tokens
    setup.do_sample = False
    if all(r.seed is None for r in batch):
        return setup, {}
    for name in ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"):
        value = effective_generation_value(config, name)
        if value not in (None, 0.0, 1.0):
            raise ValueError(f"per-request seeded sampling does not implement generation_config.{name}={value}")
    from transformers import LogitsProcessorList

    generators = [None if r.seed is None else torch.Generator().manual_seed(int(r.seed)) for r in batch]
    sampler = PerRowSampler(generators, *(effective_generation_value(config, name)
                                          for name in ("temperature", "top_k", "top_p")))
    setup.temperature, setup.top_k, setup.top_p = None, None, None
    return setup, {"logits_processor": LogitsProcessorList([sampler])}


__all__ = ["ARInput", "ARProduct", "ARStageModel", "PerRowSampler", "cut_at_eos", "effective_generation_value", "generation_setup"]
