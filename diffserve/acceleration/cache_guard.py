"""The run-time quality guard of step caching: one request's online estimate of the error its
skipped steps have put into its result, and the rule that computes a step whenever skipping
it would take that estimate past the request's budget.

What the guard sees, per request, all from tensors the cache computes anyway:

* the a-priori error of a skipped step's forecast: the size of the forecast's next Taylor
  term at that step (`diffserve.acceleration.forecast.Forecaster.remainder`: the trend of the
  computed residuals), relative to the size of the blocks' output; before enough steps are
  computed for it, the TeaCache estimate of the output's change since the last computed step
  (the rescaled change of the modulated input);
* at every computed step that follows skipped ones (the level's ``interval`` makes one at
  least every few steps: the check steps), the forecast's actual error at that step, measured
  against the computed residual. Their ratio corrects the a-priori estimates of the skipped
  steps since the previous check and scales those of the steps to come.

Each skipped step adds its estimate weighted by its step size (``|t_i - t_i+1| / t_0``: an
error in the model output at step ``i`` moves the sample by about that fraction of the
trajectory), so the estimate reads as the relative error of the final latents. The level's
``budget`` (`diffserve.acceleration.cache_quality`) bounds it; what PSNR a budget gives was
measured on the built-in model. No skip is taken that the estimate says would exceed the
budget; a check step can still raise the estimate afterwards (it measures what the skips
before it really cost), so a request's final estimate may end above its budget: it is reported
as it stands (`RequestMetrics.cache_error_estimate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

#: Bounds of the correction factor a check step measures (measured / a-priori error).
MIN_CORRECTION, MAX_CORRECTION = 0.25, 16.0


@dataclass(frozen=True)
class GuardState:
    """One request's error estimate (immutable: each update returns a new one, so saving a
    request's caching state is a shallow copy).

    Attributes:
        committed: estimated error of the skipped steps before the last computed step.
        pending: a-priori error (uncorrected) of the skipped steps since the last computed step.
        correction: measured / a-priori error at the last check step (1 before any).
        checks: check steps so far (computed steps whose forecast error was measured).
        last_measured: the forecast's relative error measured at the last check step.
    """

    committed: float = 0.0
    pending: float = 0.0
    correction: float = 1.0
    checks: int = 0
    last_measured: float | None = None

    @property
    def estimate(self) -> float:
        """The current estimate of the request's accumulated error (relative, >= 0)."""
        return self.committed + self.correction * self.pending

    def allows(self, step_error: float, weight: float, budget: float) -> bool:
        """Whether skipping a step with a-priori error `step_error` and weight `weight` keeps
        the estimate within `budget` (always False for a zero budget)."""
        if budget <= 0 or not math.isfinite(step_error):
            return False
        return self.committed + self.correction * (self.pending + weight * step_error) <= budget

    def skipped(self, step_error: float, weight: float) -> "GuardState":
        """After skipping a step (its a-priori error and weight)."""
        return replace(self, pending=self.pending + weight * step_error)

    def computed(self, measured: float | None, predicted: float | None) -> "GuardState":
        """After a computed step; `measured` / `predicted`: the forecast's actual and a-priori
        relative error at this step when a forecast existed (a check step), else None."""
        correction, checks = self.correction, self.checks
        if measured is not None and predicted is not None and predicted > 0:
            correction = min(MAX_CORRECTION, max(MIN_CORRECTION, measured / predicted))
            checks += 1
        committed = self.committed + correction * self.pending
        return GuardState(committed, 0.0, correction, checks, measured if measured is not None else self.last_measured)
