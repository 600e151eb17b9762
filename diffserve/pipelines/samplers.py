"""Per-request samplers: a request's ``scheduler`` names the diffusion scheduler it runs with, as
AUTOMATIC1111 / ComfyUI users pick a sampler per image. Requests with different samplers still
share denoiser forwards: the sampler is per-request state, never part of the batch key; each
request gets its own scheduler instance (`diffusion_scheduler.new_scheduler` of the sampler's
template), and the step of a mixed batch is per row (`diffusion_scheduler.step_batch`: flow-matching
Euler rows in one tensor expression, the others with their own scheduler's ``step``).

Each name maps to a diffusers scheduler class and config overrides applied on top of the model
folder's scheduler config (``Class.from_config(folder_config, **overrides)``: what one does to
``pipe.scheduler`` in diffusers, so a request equals diffusers with that scheduler set), one
mapping per kind of model the sampler supports: noise-prediction models (``prediction_type``
``epsilon`` or ``v_prediction``: SD 1.x/2.x, SDXL) and flow-matching models (``flow_prediction``:
SD3, Flux, Qwen-Image, Wan). The A1111 names follow diffusers' scheduler overview table
(docs/source/en/api/schedulers/overview.md):

===================  ==========================  ====================================================  ==================================================
name                 A1111                       epsilon / v_prediction                               flow_prediction
===================  ==========================  ====================================================  ==================================================
``euler``            Euler                       EulerDiscreteScheduler                               FlowMatchEulerDiscreteScheduler (``shift`` = the folder's)
``euler_a``          Euler a                     EulerAncestralDiscreteScheduler                      -
``dpmpp_2m``         DPM++ 2M                    DPMSolverMultistepScheduler (dpmsolver++, order 2)   DPMSolverMultistepScheduler (flow sigmas, ``flow_shift``)
``dpmpp_2m_karras``  DPM++ 2M, Karras            as dpmpp_2m, ``use_karras_sigmas``                   -
``dpmpp_sde``        DPM++ SDE                   DPMSolverSinglestepScheduler (sde-dpmsolver++)       -
``ddim``             DDIM                        DDIMScheduler (``eta``: the request's)               -
``unipc``            UniPC                       UniPCMultistepScheduler                              UniPCMultistepScheduler (flow sigmas, ``flow_shift``)
``lcm``              LCM                         LCMScheduler                                         -
===================  ==========================  ====================================================  ==================================================

Why some are noise-prediction only: Karras sigmas are defined on a model's training noise
levels (``alphas_cumprod``), which flow models do not have; DDIM's and LCM's updates are
written for epsilon / v / sample predictions; and the stochastic samplers (``euler_a``,
``dpmpp_sde``) draw per-step noise from the generator the pipeline passes to the step, which
diffusers' SD / SDXL pipelines do and its flow pipelines do not (their results would not be
reproducible from the seed; `diffusion_scheduler.Stepping.step_kwargs`). A family offers the names valid for its prediction type whose
scheduler sets a schedule from the arguments the family passes (`SamplerTemplates.available`
tries it once): Qwen-Image passes custom ``sigmas``, which ``DPMSolverMultistepScheduler`` does not
take, and Flux always passes ``mu``, which DPM-Solver and UniPC take only with dynamic shifting
(FLUX.1-dev's config, not schnell's).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: ``prediction_type`` values of noise-prediction models.
NOISE_PREDICTION = ("epsilon", "v_prediction")
FLOW_PREDICTION = "flow_prediction"


def _flow_solver(config: dict[str, Any]) -> dict[str, Any]:
    """DPM-Solver / UniPC on a flow-matching model: flow sigmas shifted by the folder's shift."""
    return {"prediction_type": FLOW_PREDICTION, "use_flow_sigmas": True,
            "flow_shift": float(config.get("flow_shift", config.get("shift", 1.0)))}


def _flow_euler(config: dict[str, Any]) -> dict[str, Any]:
    """Flow-matching Euler with the folder's shift (a UniPC folder calls it ``flow_shift``)."""
    return {"shift": float(config.get("shift", config.get("flow_shift", 1.0)))}


@dataclass(frozen=True)
class Sampler:
    """One row of the table (see the module docstring).

    Attributes:
        name: the request's ``scheduler`` value (its A1111 name and schedule type:
            `diffserve.core.sampling_params.A1111_SAMPLERS`).
        noise: (diffusers class name, overrides) for noise-prediction models, or None.
        flow: (class name, ``overrides(folder_config) -> dict``) for flow models, or None.
    """

    name: str
    noise: tuple[str, dict[str, Any]] | None = None
    flow: tuple[str, Callable[[dict[str, Any]], dict[str, Any]]] | None = None


_NOT_KARRAS = {"use_karras_sigmas": False}
SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("euler", noise=("EulerDiscreteScheduler", _NOT_KARRAS),
            flow=("FlowMatchEulerDiscreteScheduler", _flow_euler)),
    Sampler("euler_a", noise=("EulerAncestralDiscreteScheduler", {})),
    Sampler("dpmpp_2m", noise=("DPMSolverMultistepScheduler",
                               {"algorithm_type": "dpmsolver++", "solver_order": 2, **_NOT_KARRAS}),
            flow=("DPMSolverMultistepScheduler", _flow_solver)),
    Sampler("dpmpp_2m_karras",
            noise=("DPMSolverMultistepScheduler",
                   {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True})),
    Sampler("dpmpp_sde", noise=("DPMSolverSinglestepScheduler",
                                {"algorithm_type": "sde-dpmsolver++", "solver_order": 2, **_NOT_KARRAS})),
    Sampler("ddim", noise=("DDIMScheduler", {})),
    Sampler("unipc", noise=("UniPCMultistepScheduler", _NOT_KARRAS),
            flow=("UniPCMultistepScheduler", _flow_solver)),
    Sampler("lcm", noise=("LCMScheduler", {})),
)}


def prediction_type(scheduler: Any) -> str:
    """What the model behind a scheduler predicts, from the scheduler's class and config:
    ``flow_prediction`` for flow-matching schedulers (``FlowMatch*`` classes, flow sigmas),
    else the config's ``prediction_type`` (``epsilon`` by default)."""
    config = scheduler.config
    if (type(scheduler).__name__.startswith("FlowMatch") or config.get("use_flow_sigmas")
            or config.get("prediction_type") == FLOW_PREDICTION):
        return FLOW_PREDICTION
    return config.get("prediction_type") or "epsilon"


def _accepted(cls: type, overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides `cls.__init__` takes (a folder config's other keys are ignored by
    ``from_config`` anyway)."""
    names = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in overrides.items() if k in names}


@dataclass
class SamplerTemplates:
    """The samplers of one model: a template scheduler per name, built once from the folder's
    scheduler (requests copy it with `diffusion_scheduler.new_scheduler`).

    Args:
        base: the folder's scheduler (the default when a request names none).
        timestep_arguments: ``f(scheduler, num_steps) -> {name: value}``: example
            ``set_timesteps`` arguments the family passes for that scheduler besides the step
            count and device (e.g. ``{"sigmas": ..., "mu": ...}``); a sampler whose scheduler
            cannot set a schedule from them is not offered.
    """

    base: Any
    timestep_arguments: Callable[[Any, int], dict[str, Any]] = lambda scheduler, num_steps: {}
    _templates: dict[str, Any] = field(default_factory=dict)

    @property
    def prediction_type(self) -> str:
        return prediction_type(self.base)

    def _build(self, name: str) -> Any | None:
        import diffusers

        sampler = SAMPLERS[name]
        kind = self.prediction_type
        if kind in NOISE_PREDICTION and sampler.noise is not None:
            class_name, overrides = sampler.noise
        elif kind == FLOW_PREDICTION and sampler.flow is not None:
            class_name, make = sampler.flow
            overrides = make(dict(self.base.config))
        else:
            return None
        cls = getattr(diffusers, class_name)
        template = cls.from_config(self.base.config, **_accepted(cls, overrides))
        try:  # the family's schedule arguments, once, on a copy
            copy.deepcopy(template).set_timesteps(4, device="cpu", **self.timestep_arguments(template, 4))
        except Exception as exc:  # noqa: BLE001 - a scheduler that cannot take them is not offered
            logger.debug("sampler %s (%s) not offered: %s", name, class_name, exc)
            return None
        return template

    def template(self, name: str | None) -> Any:
        """The template scheduler of sampler `name` (None: the folder's own).

        Raises:
            KeyError: `name` is not one of `available`.
        """
        if name is None:
            return self.base
        if name not in self._templates:
            template = self._build(name) if name in SAMPLERS else None
            if template is None:
                raise KeyError(name)
            self._templates[name] = template
        return self._templates[name]

    def available(self) -> tuple[str, ...]:
        """The names this model offers, in table order (built and checked once)."""
        names = []
        for name in SAMPLERS:
            try:
                self.template(name)
            except KeyError:
                continue
            names.append(name)
        return tuple(names)


def takes_eta(scheduler: Any) -> bool:
    """Whether a scheduler's ``step`` takes ``eta`` (DDIM-type schedulers)."""
    return "eta" in inspect.signature(scheduler.step).parameters
