"""Quantize a freshly loaded model as its `EngineConfig` asks (after load, before compile and
offload), calibrating the automatic skip list on the adapter's own step contract
(`diffserve.runner.calibration`). The work itself is `diffserve.quantization.plan`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from diffserve.core.errors import InvalidRequestError
from diffserve.core.quantization import AUTO
from diffserve.quantization.plan import QuantizationResult, quantize_model

if TYPE_CHECKING:
    from diffserve.config import EngineConfig
    from diffserve.pipelines.base import PipelineAdapter

logger = logging.getLogger(__name__)


def quantize_adapter(adapter: "PipelineAdapter", config: "EngineConfig") -> QuantizationResult:
    """Quantize the adapter's components (``adapter.modules()``) as `config` asks; components
    that arrived quantized (pre-quantized folder, GGUF file) are only reported.

    Raises:
        InvalidRequestError: field ``quantization``: a mapping names a component the folder
            does not have.
    """
    from diffserve.runner.calibration import record_calibration

    result = quantize_model(adapter.modules(), config.quantization_spec, config.torch_dtype,
                            calibrate=lambda names: record_calibration(adapter, names, config.limits))
    _log(result)
    return result


def quantize_pipeline(pipe: Any, config: "EngineConfig") -> QuantizationResult:
    """Quantize a whole-request pipeline's components (``pipe.components``) as `config` asks.

    Raises:
        InvalidRequestError: field ``quantization`` (an unknown component), or
            ``quantization_skip="auto"``: the automatic search calibrates through a step adapter,
            which this pipeline class has not.
    """
    spec = config.quantization_spec
    if spec.skip == AUTO:
        raise InvalidRequestError("quantization_skip", AUTO, "layer-name patterns or none: the pipeline class "
                                  f"{type(pipe).__name__} has no step adapter to calibrate the automatic search on")
    components = dict(getattr(pipe, "components", {}) or {})
    result = quantize_model(components, spec, config.torch_dtype)
    _log(result)
    return result


def _log(result: QuantizationResult) -> None:
    for name, report in result.reports.items():
        ratio = f", {report.ratio:.3f}x of {report.full_precision_bytes / 2**20:.1f} MiB" if report.ratio else ""
        kept = f", kept in full precision: {', '.join(report.kept_layers)}" if report.kept_layers else ""
        logger.info("%s: %s (%s), %d quantized linear layers, %.1f MiB%s%s", name, report.method, report.source,
                    report.quantized_layers, report.bytes / 2**20, ratio, kept if len(report.kept_layers) <= 20
                    else f", {len(report.kept_layers)} layers kept in full precision")
