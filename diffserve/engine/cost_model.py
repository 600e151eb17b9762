"""`StepCostModel`: the request scheduler's online model of a denoising step's duration.

A step's wall time on one device grows with the work in its forward: about linear in the image
token slots it processes (rows x the widest row's image tokens: a forward of mixed sizes pads
every row to the widest, `diffserve.engine.queues`; at one size, rows x tokens per row; the
attention's quadratic part shows up as a steeper slope at larger sizes) plus a fixed cost (host
work, the text context, kernel launches). The model fits ``seconds = a + b * tokens`` by
exponentially weighted least squares over the steps the engine runs (forgetting factor `decay`
per step, so it follows load changes: other processes, a cache backend warming up).

Real step costs are not straight lines: on a CPU (and on a GPU below saturation) a bigger
forward uses the hardware better, so the cost per token falls as the batch grows, and a line
fitted over all sizes overpredicts the large steps and underpredicts the small ones (measured on
the built-in model: a 16-row step predicted at 14-19 ms took 11 ms; docs/scheduling.md). So the
model also keeps, per half-octave of token counts (`bucket`), the exponentially weighted mean
point (tokens, seconds) of the steps observed there, and `predict` interpolates linearly between
the mean points of the nearest populated buckets on each side; outside the observed range it
continues from the nearest mean point with the line's slope (below it, at least proportionally
to that point). The points are made non-decreasing (each at least its smaller neighbour's
seconds), so noise never makes a bigger step look cheaper. Where the cost is truly linear the
mean points lie on the line, so both agree.
The ``slo`` scheduling policy (slack, the deadline-aware batch size), ``--admission slo``, the
automatic padding decision (``--max-padding-ratio auto``, `diffserve.engine.queues`) and the
request scheduler's join wait read `predict`.

Cost: one update is a few float operations per step and one dict update; a prediction is a
binary search over at most ~40 buckets (their sorted points are cached between updates).
"""

from __future__ import annotations

import bisect
import itertools
import math


def bucket(tokens: float) -> int:
    """The half-octave bucket of a step of `tokens` image tokens (slots): ``floor(2 log2 t)``
    (0 for t <= 1), so a bucket spans a factor of sqrt(2)."""
    return int(2 * math.log2(tokens)) if tokens > 1 else 0


class StepCostModel:
    """Step seconds vs image tokens in the forward, fitted online (see the module docstring).

    Args:
        decay: weight kept by past steps at each new one, in (0, 1) (0.98: ~50 steps of memory);
            a bucket's mean point forgets by the same factor per step observed in it.
    """

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.steps = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        #: bucket -> [weight, weighted tokens, weighted seconds]
        self._buckets: dict[int, list[float]] = {}
        #: the buckets' mean points sorted by tokens: (tokens list, seconds list); None = stale
        self._points: tuple[list[float], list[float]] | None = None

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
        key = bucket(tokens)
        entry = self._buckets.get(key)
        if entry is None:
            self._buckets[key] = [1.0, float(tokens), seconds]
        else:
            entry[0] = entry[0] * d + 1.0
            entry[1] = entry[1] * d + tokens
            entry[2] = entry[2] * d + seconds
        self._points = None

    def coefficients(self) -> tuple[float, float] | None:
        """The line's (a seconds, b seconds per token), or None before the first step. With one
        distinct load so far the slope is taken as proportional (a = 0)."""
        if not self._w:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var <= 1e-9 * max(mean_x * mean_x, 1.0):
            return (0.0, mean_y / mean_x) if mean_x > 0 else (mean_y, 0.0)
        slope = max((self._xy / self._w - mean_x * mean_y) / var, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope

    def predict(self, tokens: float) -> float | None:
        """Predicted seconds of a step over `tokens` image tokens: interpolated between the
        observed buckets' mean points around it, continued with the line's slope outside them
        (the module docstring); None before the first observed step."""
        fit = self.coefficients()
        if fit is None:
            return None
        if self._points is None:
            points = sorted((s[1] / s[0], s[2] / s[0]) for s in self._buckets.values())
            ys = list(itertools.accumulate((p[1] for p in points), max))  # more tokens never cost less
            self._points = ([p[0] for p in points], ys)
        xs, ys = self._points
        i = bisect.bisect_left(xs, tokens)
        if 0 < i < len(xs):
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0) if x1 > x0 else y1
        if i < len(xs) and xs[i] == tokens:
            return ys[i]
        b = fit[1]
        if i >= len(xs) and xs:  # above the observed range: the last point, the line's slope
            return ys[-1] + b * (tokens - xs[-1])
        if xs:  # below it: the first point, the line's slope, at least proportional to it
            return max(ys[0] - b * (xs[0] - tokens), ys[0] * tokens / xs[0])
        return fit[0] + b * tokens

    def stats(self) -> dict:
        """``{"steps", "intercept_s", "seconds_per_token"}`` (the line; None before the first
        step)."""
        fit = self.coefficients()
        return {"steps": self.steps, "intercept_s": None if fit is None else fit[0],
                "seconds_per_token": None if fit is None else fit[1]}


__all__ = ["StepCostModel", "bucket"]
