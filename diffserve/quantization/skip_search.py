"""The automatic skip list: which linear layers of a denoiser stay in full precision.

Quantization error is not spread evenly over a model: a few layers (outlier channels, a block
whose output dominates the residual stream) can carry most of it. vLLM-Omni's FP8 guide keeps
layers by hand (Qwen-Image's ``img_mlp``); here they are chosen by measurement at load.

Method (post-training sensitivity analysis, as in mixed-precision PTQ: e.g. Dong et al.,
"HAWQ", ICCV 2019, ranks layers by their effect on the output; here the effect is measured
directly instead of through the Hessian):

1. Record the denoiser's inputs on a few calibration prompts at timesteps across the schedule
   (`CalibrationInputs`); its full-precision outputs ``y`` are the reference.
2. The error of a set of quantized layers is the relative L2 error of the outputs over all
   calibration inputs, ``||y_q - y|| / ||y||``.
3. Each candidate layer's sensitivity ``e_l`` is that error with only layer ``l`` quantized
   (one replay per layer). When the layers' errors are independent, the squared errors add up
   (``e^2 ~ sum e_l^2``), so keeping the most sensitive layers first removes the most error
   per kept layer.
4. With every layer quantized, if the error is within the budget nothing is kept; otherwise a
   binary search over ``k`` finds the fewest most-sensitive layers to keep whose measured
   error is within the budget (``log2(N)`` more replays).

Cost: ``N + log2(N) + 2`` replays of the calibration inputs for ``N`` linear layers, with the
full-precision and the quantized weights both held meanwhile (1.25x the fp32 weights of the
denoiser for int8).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from diffserve.quantization.apply import linear_layers
from diffserve.quantization.methods import can_quantize, torchao_config

logger = logging.getLogger(__name__)


class CalibrationInputs:
    """The positional and keyword inputs of a module's forward calls, recorded and replayed.

    Use ``with inputs.record(module): ...`` around code that calls `module` (e.g. denoising a
    few calibration requests); every call's inputs are cloned. `replay` runs the module on
    each and returns the first tensor of each output.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __len__(self) -> int:
        return len(self.calls)

    @contextmanager
    def record(self, module: torch.nn.Module):
        """Record `module`'s forward inputs (cloned) while the block runs."""

        def hook(_module, args, kwargs):
            clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
            self.calls.append((tree_map(clone, args), tree_map(clone, kwargs)))

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    @torch.inference_mode()
    def replay(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The first output tensor of `module` on each recorded input, in float32."""
        outputs = []
        for args, kwargs in self.calls:
            out = module(*args, **kwargs)
            first = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            outputs.append(first.float())
        return outputs


def relative_error(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """``sqrt(sum ||o - r||^2 / sum ||r||^2)`` over the paired tensors (0 when the reference is
    all zeros and so are the outputs)."""
    num = sum(float((o - r).pow(2).sum()) for o, r in zip(outputs, reference))
    den = sum(float(r.pow(2).sum()) for r in reference)
    return (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))


def layer_type(name: str) -> str:
    """A layer name with its block indices replaced by ``*`` (``transformer_blocks.3.ff.net.2``
    -> ``transformer_blocks.*.ff.net.2``): the layer's type across blocks."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


@dataclass
class SkipSearchResult:
    """What the automatic search found.

    Attributes:
        kept: layer names (relative to the module) kept in full precision, most sensitive first.
        error: the measured relative output error with exactly those layers kept.
        error_all_quantized: the error with every candidate layer quantized.
        budget: the bound the search met (or could not: then every candidate is kept).
        sensitivities: each candidate's error when quantized alone.
        replays: calibration replays run.
        seconds: wall time of the search.
    """

    kept: list[str]
    error: float
    error_all_quantized: float
    budget: float
    sensitivities: dict[str, float] = field(default_factory=dict)
    replays: int = 0
    seconds: float = 0.0

    def kept_types(self) -> dict[str, int]:
        """Kept layers counted by `layer_type`."""
        return dict(Counter(layer_type(n) for n in self.kept))


@torch.no_grad()
def search_skip_list(component: str, module: torch.nn.Module, method: str, inputs: CalibrationInputs,
                     budget: float) -> SkipSearchResult:
    """Find the fewest linear layers of `module` to keep in full precision so that quantizing
    the rest with `method` keeps its output within `budget` (see the module docstring).

    The module is left as it was (full precision); quantize it afterwards with
    `apply.quantize_component(..., kept=result.kept)`.

    Args:
        component: its name in the folder (for the log).
        inputs: recorded calibration inputs (at least one call).
        budget: bound on the relative L2 output error, a fraction (e.g. 0.03).

    Raises:
        ValueError: no calibration inputs.
    """
    from torchao.quantization import quantize_

    if not len(inputs):
        raise ValueError("the automatic skip list needs calibration inputs (none were recorded)")
    start = time.perf_counter()
    layers = {n: m for n, m in linear_layers(module).items() if can_quantize(m, method)}
    reference = inputs.replay(module)
    replays = 1
    full = {n: m.weight for n, m in layers.items()}
    quantize_(module, torchao_config(method), filter_fn=lambda m, fqn: fqn in layers)
    quantized = {n: m.weight for n, m in layers.items()}

    def error_with(kept: set[str]) -> float:
        nonlocal replays
        for n, m in layers.items():
            m.weight = full[n] if n in kept else quantized[n]
        replays += 1
        return relative_error(inputs.replay(module), reference)

    try:
        error_all = error_with(set())
        if error_all <= budget or not layers:
            result = SkipSearchResult([], error_all, error_all, budget, replays=replays)
        else:
            names = list(layers)
            sensitivities = {n: error_with(set(names) - {n}) for n in names}
            order = sorted(names, key=lambda n: -sensitivities[n])
            lo, hi, error_hi = 0, len(order), 0.0  # error(lo) > budget >= error(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                error_mid = error_with(set(order[:mid]))
                if error_mid <= budget:
                    hi, error_hi = mid, error_mid
                else:
                    lo = mid
            result = SkipSearchResult(order[:hi], error_hi, error_all, budget, sensitivities, replays)
    finally:
        for n, m in layers.items():
            m.weight = full[n]
    result.seconds = time.perf_counter() - start
    result.replays = replays
    logger.info("automatic skip list for %s (%s, budget %.3g): error %.4g with every layer quantized, %.4g "
                "keeping %d of %d layers %s (%d replays, %.1f s)", component, method, budget, result.error_all_quantized,
                result.error, len(result.kept), len(layers), result.kept_types(), result.replays, result.seconds)
    return result
