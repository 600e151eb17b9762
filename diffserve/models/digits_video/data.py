"""Training clips and prompts for the built-in video model: handwritten digits that move.

A clip is one 8x8 digit of scikit-learn's ``load_digits`` (the image model's data, with the same
fixed stratified 80/20 split: :func:`diffserve.models.digits.data.load_split`; held-out digits
are never trained on) pasted on a black ``CANVAS_SIZE`` x ``CANVAS_SIZE`` canvas and shifted by
``SPEED`` pixels per frame in one of four directions, from one edge of the canvas to the other
(8 pixels over the 9 frames). Positions are integers, so every frame holds an exact copy of the
8x8 digit (no resampling blur) and the judge can crop it back out.

Directions are screen directions: ``"up"`` decreases the row index, ``"right"`` increases the
column index.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from diffserve.models.digits import data as digit_data
from diffserve.models.digits.data import DIGIT_WORDS, MAX_INTENSITY

#: Side of the square canvas, pixels (``WanPipeline`` wants multiples of 16).
CANVAS_SIZE = 16
#: Side of a digit, pixels (the ``load_digits`` images are 8x8).
DIGIT_SIZE = digit_data.IMAGE_SIZE
#: Frames per clip: Wan's rule ``4k + 1`` for a VAE with 4x temporal down-sampling (k = 2).
NUM_FRAMES = 9
#: Frames per second the clips are meant to be played at (metadata only).
FPS = 8

#: Direction name -> unit (row step, column step) per frame.
DIRECTIONS: dict[str, tuple[int, int]] = {
    "left": (0, -1),
    "right": (0, 1),
    "up": (-1, 0),
    "down": (1, 0),
}
DIRECTION_NAMES: tuple[str, ...] = tuple(DIRECTIONS)
#: Pixels the digit moves per frame.
SPEED = 1

#: Motion phrases of the prompts; ``{dir}`` is a direction name.
MOTION_TEMPLATES: tuple[str, ...] = (
    "moving {dir}",
    "going {dir}",
    "sliding {dir}",
    "that moves {dir}",
    "moving to the {dir}",
    "moves {dir}",
)

#: Words that appear in the motion phrases (the tokenizer gives each a whole-word piece).
MOTION_WORDS: tuple[str, ...] = (
    "moving", "moves", "going", "sliding", "that", "to", "left", "right", "up", "down",
)


@dataclass(frozen=True)
class ClipSpec:
    """What a clip shows: ``digit`` (0..9) moving ``direction`` (one of :data:`DIRECTION_NAMES`)."""

    digit: int
    direction: str


def trajectory(
    direction: str, rng: random.Random, num_frames: int = NUM_FRAMES, canvas: int = CANVAS_SIZE
) -> np.ndarray:
    """Random top-left corners of the digit, one per frame, for a path that stays on the canvas.

    The coordinate across the motion is uniform in ``0..canvas-8``; the start along it is uniform
    over the starts whose whole path fits (a single one with the defaults: edge to edge).

    Returns:
        int64 array (num_frames, 2) of (row, column), each in ``0..canvas-8``.

    Raises:
        ValueError: if the path does not fit on the canvas.
    """
    travel = SPEED * (num_frames - 1)
    room = canvas - DIGIT_SIZE
    if travel > room:
        raise ValueError(f"a clip of {num_frames} frames travels {travel} pixels; the canvas leaves {room}")
    d_row, d_col = DIRECTIONS[direction]
    cross = rng.randint(0, room)
    along = rng.randint(0, room - travel)
    if d_row + d_col < 0:  # moving towards smaller indices: start at the far end
        along += travel
    t = np.arange(num_frames)
    if d_row:
        rows, cols = along + d_row * SPEED * t, np.full(num_frames, cross)
    else:
        rows, cols = np.full(num_frames, cross), along + d_col * SPEED * t
    return np.stack([rows, cols], axis=1).astype(np.int64)


def render_clip(digit_image: np.ndarray, corners: np.ndarray, canvas: int = CANVAS_SIZE) -> np.ndarray:
    """Paste an 8x8 digit at each frame's top-left corner on a black canvas.

    Args:
        digit_image: (8, 8) intensities 0..16 (a ``load_digits`` image).
        corners: int (F, 2) top-left (row, column) per frame, from :func:`trajectory`.

    Returns:
        float32 (F, canvas, canvas), intensities 0..16.
    """
    frames = np.zeros((len(corners), canvas, canvas), dtype=np.float32)
    for f, (r, c) in enumerate(corners):
        frames[f, r : r + DIGIT_SIZE, c : c + DIGIT_SIZE] = digit_image
    return frames


def to_model_range(frames: np.ndarray) -> torch.Tensor:
    """Grayscale clips (N, F, H, W), intensities 0..16, to RGB float32 (N, 3, F, H, W) in [-1, 1].

    The three channels are equal: the Wan VAE takes RGB video (``in_channels=3``), as every Wan
    checkpoint does, so the pipeline's output is ordinary RGB video.
    """
    x = torch.as_tensor(np.asarray(frames, dtype=np.float32)) / (MAX_INTENSITY / 2) - 1.0
    return x.unsqueeze(1).expand(-1, 3, -1, -1, -1).contiguous()


def sample_specs(labels: np.ndarray, rng: random.Random) -> list[ClipSpec]:
    """One uniformly random direction per digit label."""
    return [ClipSpec(int(d), rng.choice(DIRECTION_NAMES)) for d in labels]


def make_clips(
    images: np.ndarray, specs: list[ClipSpec], rng: random.Random, num_frames: int = NUM_FRAMES
) -> tuple[np.ndarray, np.ndarray]:
    """Render one clip per (image, spec) pair at random positions.

    Args:
        images: (N, 8, 8) digit images, intensities 0..16.
        specs: N clip specs (their ``digit`` is only carried along; ``images`` decide the pixels).

    Returns:
        ``(frames, corners)``: float32 (N, F, 16, 16) intensities 0..16 and int64 (N, F, 2).
    """
    corners = np.stack([trajectory(s.direction, rng, num_frames) for s in specs])
    frames = np.stack([render_clip(img, c) for img, c in zip(images, corners)])
    return frames, corners


def format_prompt(subject_template: str, motion_template: str, spec: ClipSpec) -> str:
    """Prompt for a clip: the image model's subject template, then a motion phrase.

    ``format_prompt("a handwritten digit {d}", "moving {dir}", ClipSpec(3, "left"))`` gives
    ``"a handwritten digit 3 moving left"``.

    Raises:
        IndexError: if ``spec.digit`` is outside 0..9.
    """
    subject = digit_data.format_prompt(subject_template, spec.digit)
    return f"{subject} {motion_template.format(dir=spec.direction)}"


def sample_training_prompts(specs: list[ClipSpec], rng: random.Random, empty_prob: float) -> list[str]:
    """One training prompt per clip: a training subject template (the image model's
    :data:`~diffserve.models.digits.data.TRAIN_TEMPLATES`) with a random :data:`MOTION_TEMPLATES`
    phrase, or ``""`` with probability ``empty_prob``.

    ``""`` is the Wan pipeline's default negative prompt, so dropping captions this way trains
    the unconditional branch of classifier-free guidance (Ho & Salimans 2022, arXiv:2207.12598).
    """
    prompts = []
    for spec in specs:
        if rng.random() < empty_prob:
            prompts.append("")
        else:
            subject = rng.choice(digit_data.TRAIN_TEMPLATES)
            prompts.append(format_prompt(subject, rng.choice(MOTION_TEMPLATES), spec))
    return prompts


__all__ = [
    "CANVAS_SIZE", "DIGIT_SIZE", "NUM_FRAMES", "FPS", "DIRECTIONS", "DIRECTION_NAMES", "SPEED",
    "MOTION_TEMPLATES", "MOTION_WORDS", "DIGIT_WORDS", "ClipSpec", "trajectory", "render_clip",
    "to_model_range", "sample_specs", "make_clips", "format_prompt", "sample_training_prompts",
]
