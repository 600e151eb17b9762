"""Forecasting a request's transformer-block residual at a skipped step from its computed ones.

TaylorSeer (Liu et al. 2025, "From Reusing to Forecasting: Accelerating Diffusion Models with
TaylorSeers", arXiv:2503.06923) predicts a skipped step's features with a Taylor expansion
whose derivatives are finite differences of the features of the last fully computed steps.
Here the expansion variable is the denoiser's timestep itself and the derivatives are Newton
divided differences over the computed steps' timesteps, which is the same expansion on the
uniform grid TaylorSeer uses and stays exact for polynomials on the non-uniform (shifted)
grids of flow-matching schedules. Order 0 is TeaCache's reuse of the last residual.

The next Newton term (one order higher, from one more computed step) is the expansion's
remainder: its size at the forecast timestep is the a-priori error estimate the run-time
guard (`diffserve.acceleration.cache_guard`) starts from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Forecaster:
    """Newton form of one request's residual trajectory through its last computed steps.

    Built once per computed step (`fit`); forecasting is a few fused multiply-adds, and the
    remainder estimate is plain float arithmetic (no tensor work at a skipped step).

    Attributes:
        nodes: timesteps of the computed steps used, newest first (floats).
        coefficients: Newton divided differences ``f[t_k]``, ``f[t_k, t_k-1]``, ... (tensors
            of the residual's shape (rows, N, D) and dtype), as many as the forecast order + 1.
        remainder_size: ``mean|f[t_k, ..., t_k-m-1]|`` of the next order (None: not enough
            computed steps for it).
    """

    nodes: tuple[float, ...]
    coefficients: tuple[torch.Tensor, ...]
    remainder_size: float | None

    @property
    def order(self) -> int:
        return len(self.coefficients) - 1

    @classmethod
    def fit(cls, history: list[tuple[float, torch.Tensor]], order: int) -> "Forecaster":
        """The forecaster of order ``min(order, len(history) - 1)`` through the newest points of
        `history` ((timestep, residual) pairs, oldest first), with the remainder's size when
        one more point is available.

        Raises:
            ValueError: `history` is empty.
        """
        if not history:
            raise ValueError("Forecaster.fit needs at least one computed step")
        order = max(0, min(order, len(history) - 1))
        points = history[::-1][: order + 2]  # newest first
        nodes = [t for t, _ in points]
        table = [r for _, r in points]
        coefficients = [table[0]]
        remainder = None
        for level in range(1, len(points)):
            table = [(table[j] - table[j + 1]) / (nodes[j] - nodes[j + level]) for j in range(len(table) - 1)]
            if level <= order:
                coefficients.append(table[0])
            else:
                remainder = float(table[0].abs().mean())
        return cls(tuple(nodes[: order + 1]), tuple(coefficients), remainder)

    def _basis(self, t: float, terms: int) -> float:
        product = 1.0
        for node in self.nodes[:terms]:
            product *= t - node
        return product

    def predict(self, t: float) -> torch.Tensor:
        """The forecast residual at timestep `t` (a new tensor, the residual's shape)."""
        out = self.coefficients[0]
        for k in range(1, len(self.coefficients)):
            out = out + self._basis(t, k) * self.coefficients[k]
        return out if len(self.coefficients) > 1 else out.clone()

    def remainder(self, t: float) -> float | None:
        """``mean|next Newton term|`` at `t`: the forecast's a-priori error (in the residual's
        units), None without enough computed steps."""
        if self.remainder_size is None:
            return None
        return self.remainder_size * abs(self._basis(t, self.order + 1))
