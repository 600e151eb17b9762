"""A stream between its chunks, on the worker that owns it: which chunk runs, the frames
emitted so far, and the prompt transitions of interactions.

An interaction (new prompt P, ``transition_chunks`` k) applied before chunk c moves the
conditional branch's prompt inputs from those chunk c - 1 used (the *source*, itself possibly a
blend) to P's encoding (the *target*) by linear interpolation over k + 1 chunks: chunk c + j uses
``lerp(source, target, (j + 1) / (k + 1))`` for j = 0..k, so with k = 1 chunk c is the halfway
blend and chunk c + 1 uses P alone; k = 0 switches at chunk c. Linear interpolation between
two text embeddings moves the generation smoothly from one text to the other (used for edits
by Imagic, Kawar et al. 2023, arXiv:2210.09276, sec. 3); for Wan the blended inputs are the
zero-padded UMT5 states of both prompts. A later interaction starts from whatever the previous
chunk used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from diffserve.core.messages import Interaction


def blend_inputs(source: Any, target: Any, weight: float) -> Any:
    """``source + weight * (target - source)`` for every floating-point tensor of two denoiser
    input structures of the same layout (dicts and lists walked recursively); any other value
    is taken from `target`.

    Tensors (N, L, D) whose text lengths L differ are first right-padded with zero rows to the
    longer one: prompt inputs that end in zero padding rows (Wan with context folding keeps the
    tokens' rows plus one zero row that stands for all padding rows) blend exactly as their
    unfolded, full-length forms would.

    Raises:
        ValueError: tensors whose shapes differ in more than the text length.
    """
    if isinstance(target, dict):
        return {k: blend_inputs(source[k], v, weight) for k, v in target.items()}
    if isinstance(target, (list, tuple)):
        return type(target)(blend_inputs(a, b, weight) for a, b in zip(source, target))
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        if source.dim() == 3 and source.shape[::2] == target.shape[::2] and source.shape[1] != target.shape[1]:
            length = max(source.shape[1], target.shape[1])
            source, target = (torch.nn.functional.pad(t, (0, 0, 0, length - t.shape[1])) for t in (source, target))
        if source.shape != target.shape:
            raise ValueError(f"cannot blend prompt inputs of shapes {tuple(source.shape)} and {tuple(target.shape)}")
        return torch.lerp(source.to(target.dtype), target, weight)
    return target


@dataclass
class PromptTransition:
    """The conditional branch moving from `source` to `target`; `weights` are the target's
    weights for the coming chunks, in order (the last is 1)."""

    source: dict[str, Any]
    target: dict[str, Any]
    weights: list[float]


@dataclass
class StreamState:
    """What a stream keeps between chunks besides its `RequestState`.

    Attributes:
        num_chunks: chunks to generate.
        chunk_index: the chunk being denoised (0-based).
        frames: the frames emitted so far, one uint8 (F_k, H, W, 3) array per chunk.
        transition: the prompt transition in progress, or None.
        event_ids: event ids of the interactions the current chunk is the first to use.
    """

    num_chunks: int
    chunk_index: int = 0
    frames: list[np.ndarray] = field(default_factory=list)
    transition: PromptTransition | None = None
    event_ids: list[str] = field(default_factory=list)

    @property
    def last(self) -> bool:
        """The current chunk is the stream's last."""
        return self.chunk_index + 1 >= self.num_chunks

    def next_branch(self, current: dict[str, Any], interactions: list[tuple[Interaction, dict[str, Any]]]
                    ) -> dict[str, Any]:
        """The conditional branch's inputs for the next chunk, after applying `interactions`
        ((interaction, its prompt's encoded branch), in submission order; the last one's prompt
        wins, each starts from what the previous chunk used). Records their event ids for the
        next chunk and moves `chunk_index` on."""
        self.chunk_index += 1
        self.event_ids = [interaction.event_id for interaction, _ in interactions]
        for interaction, target in interactions:
            k = interaction.transition_chunks
            self.transition = PromptTransition(current, target, [(j + 1) / (k + 1) for j in range(k + 1)])
        if self.transition is None:
            return current
        weight = self.transition.weights.pop(0)
        target = self.transition.target
        if not self.transition.weights:
            self.transition = None
            return target
        return blend_inputs(self.transition.source, target, weight)

    def take_event_ids(self) -> list[str]:
        """The current chunk's event ids (returned once)."""
        ids, self.event_ids = self.event_ids, []
        return ids


def assemble_video(chunks: list[np.ndarray], output_type: str) -> Any:
    """The whole stream as one video of `output_type`: a uint8 array (T, H, W, 3) (``"np"``),
    a uint8 tensor (``"pt"``) or a list of PIL frames (``"pil"``).

    Raises:
        ValueError: `output_type` is ``"latent"`` (refused for streams when they are added).
    """
    video = np.concatenate(chunks, axis=0)
    if output_type == "np":
        return video
    if output_type == "pt":
        return torch.from_numpy(video)
    if output_type == "pil":
        from PIL import Image

        return [Image.fromarray(frame) for frame in video]
    raise ValueError(f"a stream cannot assemble output_type={output_type!r}")
