"""`StepBatch`: the rows of several requests gathered into one denoiser forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffserve.pipelines.base import PipelineAdapter, RequestState


@dataclass
class StepBatch:
    """Inputs of one denoiser forward and how to split its output back.

    Attributes:
        states: the requests in the batch, in row order.
        inputs: keyword tensors for the forward, each (total_rows, ...), built by
            concatenating every request's `PipelineAdapter.step_inputs` along dim 0. Per-row
            timesteps let requests at different steps share one forward.
        row_counts: rows each request contributed.
    """

    states: list[RequestState]
    inputs: dict[str, torch.Tensor]
    row_counts: list[int]

    @property
    def num_rows(self) -> int:
        return sum(self.row_counts)

    @classmethod
    def gather(cls, adapter: PipelineAdapter, states: list[RequestState]) -> "StepBatch":
        """Concatenate the step inputs of `states` (all sharing one batch key)."""
        per_state = [adapter.step_inputs(s) for s in states]
        row_counts = [next(iter(x.values())).shape[0] for x in per_state]
        if len(per_state) == 1:
            inputs = per_state[0]
        else:
            inputs = {k: torch.cat([x[k] for x in per_state], dim=0) for k in per_state[0]}
        return cls(states=states, inputs=inputs, row_counts=row_counts)

    def scatter(self, output: torch.Tensor) -> list[torch.Tensor]:
        """Split a (total_rows, ...) forward output into each request's rows."""
        return list(torch.split(output, self.row_counts, dim=0))
