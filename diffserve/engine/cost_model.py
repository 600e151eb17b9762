"""`StepCostModel`: the request scheduler's online model of a denoising step's duration.

A step's wall time on one device grows with the work in its forward: about linear in the image
token slots it processes (rows x the widest row's image tokens: a forward of mixed sizes pads
every row to the widest, `diffserve.engine.queues`; at one size, rows x tokens per row; the
attention's quadratic part shows up as a steeper slope at larger sizes) plus a fixed cost (host
work, the text context, kernel launches). The model fits ``seconds = a + b * tokens`` by
exponentially weighted least squares over the steps the engine runs (forgetting factor `decay`
per step, so it follows load changes: other processes, a cache backend warming up) and predicts
a step's time for a given load. The ``slo`` scheduling policy, ``--admission slo`` and the
automatic padding decision (``--max-padding-ratio auto``) read it (`diffserve.engine.queues`).

Cost: one update is a few float operations per step (no allocation).
"""

from __future__ import annotations


class StepCostModel:
    """Step seconds vs image tokens in the forward, fitted online (see the module docstring).

    Args:
        decay: weight kept by past steps at each new one, in (0, 1) (0.98: ~50 steps of memory).
    """

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one step of `tokens` image tokens that took `seconds` (wall clock)."""
        if seconds <= 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        self.steps += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a seconds, b seconds per token), or None before the first step. With one distinct
        load so far the slope is taken as proportional (a = 0)."""
        if not self._w:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var <= 1e-9 * max(mean_x * mean_x, 1.0):
            return (0.0, mean_y / mean_x) if mean_x > 0 else (mean_y, 0.0)
        slope = max((self._xy / self._w - mean_x * mean_y) / var, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope

    def predict(self, tokens: int) -> float | None:
        """Predicted seconds of a step over `tokens` image tokens, or None before the first
        observed step."""
        fit = self.coefficients()
        return None if fit is None else fit[0] + fit[1] * tokens

    def stats(self) -> dict:
        """``{"steps", "intercept_s", "seconds_per_token"}`` (None before the first step)."""
        fit = self.coefficients()
        return {"steps": self.steps, "intercept_s": None if fit is None else fit[0],
                "seconds_per_token": None if fit is None else fit[1]}


__all__ = ["StepCostModel"]
