"""Quantize a loaded model's components as a `QuantizationSpec` asks, and remember what was
decided (a `QuantizationPlan`: method and kept layers per component) so that weights reloaded
from the folder (sleep level 2) are quantized the same way without calibrating again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from diffserve.quantization.apply import describe_loaded, quantize_component
from diffserve.quantization.skip_search import CalibrationInputs, SkipSearchResult, search_skip_list
from diffserve.core.quantization import AUTO, DENOISER_PREFIXES, ComponentReport, QuantizationSpec

logger = logging.getLogger(__name__)

#: ``calibrate(components) -> {component: CalibrationInputs}``: records the forward inputs of
#: the named denoiser components while denoising a few calibration requests in full precision.
Calibrate = Callable[[list[str]], dict[str, CalibrationInputs]]


@dataclass
class QuantizationPlan:
    """What was decided at load, enough to quantize freshly loaded weights the same way.

    Attributes:
        methods: {component: method} of the components quantized at load.
        kept: {component: layer names kept in full precision} (relative to the component).
    """

    methods: dict[str, str] = field(default_factory=dict)
    kept: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class QuantizationResult:
    """The outcome of `quantize_model`.

    Attributes:
        spec: what was asked.
        plan: what was decided (see `QuantizationPlan`).
        reports: {component: `ComponentReport`} for every component holding quantized weights.
        searches: {component: `SkipSearchResult`} of the automatic skip list.
    """

    spec: QuantizationSpec
    plan: QuantizationPlan
    reports: dict[str, ComponentReport] = field(default_factory=dict)
    searches: dict[str, SkipSearchResult] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain data: ``{"spec": ..., "components": {name: report}}`` (logs, stats,
        ``/v1/models``)."""
        return {"spec": self.spec.as_dict(), "components": {c: r.as_dict() for c, r in self.reports.items()}}

    def summary(self) -> dict[str, Any] | None:
        """`as_dict`, or None when no component holds quantized weights."""
        return self.as_dict() if self.reports else None


def model_modules(components: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """The components that are torch modules with weights, by name."""
    return {name: m for name, m in components.items()
            if isinstance(m, torch.nn.Module) and next(m.parameters(), None) is not None}


def quantize_model(components: dict[str, Any], spec: QuantizationSpec, dtype: torch.dtype,
                   calibrate: Calibrate | None = None) -> QuantizationResult:
    """Quantize `components` in place as `spec` asks.

    Components that arrived quantized (a pre-quantized folder, a GGUF file) are reported and
    left as loaded. With ``spec.skip == "auto"`` the denoisers' kept layers are searched on
    calibration inputs from `calibrate` (`skip_search.search_skip_list`); other components
    keep only the layers matching fixed patterns.

    Args:
        dtype: the model dtype (for the reports' full-precision bytes).
        calibrate: required when ``spec.skip == "auto"`` and a denoiser is quantized.

    Raises:
        InvalidRequestError: field ``quantization``: a mapping names a component the folder does
            not have (the message lists them).
        ValueError: the automatic skip list without a `calibrate`.
    """
    modules = model_modules(components)
    result = QuantizationResult(spec, QuantizationPlan())
    for name, module in modules.items():
        report = describe_loaded(name, module, dtype)
        if report is not None:
            result.reports[name] = report
    methods = spec.component_methods(modules)
    for name in [n for n in methods if n in result.reports]:
        logger.warning("%s arrived quantized (%s, %s): left as loaded, not quantized again with %s", name,
                       result.reports[name].method, result.reports[name].source, methods.pop(name))
    patterns = spec.skip if isinstance(spec.skip, tuple) else ()
    kept: dict[str, list[str]] = {}
    denoisers = [n for n in methods if n.startswith(DENOISER_PREFIXES)]
    if spec.skip == AUTO and denoisers:
        if calibrate is None:
            raise ValueError("quantization_skip='auto' needs calibration inputs for the denoiser")
        inputs = calibrate(denoisers)
        for name in denoisers:
            search = search_skip_list(name, modules[name], methods[name], inputs[name], spec.error_budget)
            result.searches[name] = search
            kept[name] = search.kept
    for name, method in methods.items():
        report = quantize_component(name, modules[name], method, kept=kept.get(name, ()), patterns=patterns,
                                    dtype=dtype)
        if name in result.searches:
            report.error = result.searches[name].error
        result.reports[name] = report
        result.plan.methods[name] = method
        result.plan.kept[name] = [k.split(".", 1)[1] for k in report.kept_layers]
    return result


def apply_plan(components: dict[str, Any], plan: QuantizationPlan, dtype: torch.dtype) -> None:
    """Quantize freshly loaded `components` as `plan` says (same methods, same kept layers)."""
    for name in sorted(plan.methods):
        module = components.get(name)
        if isinstance(module, torch.nn.Module):
            quantize_component(name, module, plan.methods[name], kept=plan.kept.get(name, ()), dtype=dtype)
