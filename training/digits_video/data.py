"""Training clips and prompts for the built-in video model: handwritten digits that move.

A clip is one 8x8 digit of scikit-learn's ``load_digits`` (the image model's data, with the same
fixed stratified 80/20 split: :func:`training.digits.data.load_split`; held-out digits
are never trained on) pasted on a black ``CANVAS_SIZE`` x ``CANVAS_SIZE`` canvas and shifted by
``SPEED`` pixels per frame in one of four directions. The canvas wraps around (a torus): a digit
leaving one edge comes back in at the opposite one, and a clip starts anywhere along its motion,
so a clip may begin where another one ended and keep moving (what a stream's next chunk does;
issue 12). Positions are integers, so every frame holds an exact copy of the 8x8 digit (split
across the edge while it wraps; no resampling blur) and the judge can cut it back out.

A fraction :data:`SWITCH_PROB` of the training clips are *switch clips*: their first frame shows
a different digit (another label) at the same position, and the caption names the digit of the
frames after it. They teach the model what an interactive stream asks of it: a chunk conditioned
on the previous chunk's last frame, with a new prompt, continues the motion with the new digit.

Directions are screen directions: ``"up"`` decreases the row index, ``"right"`` increases the
column index.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from diffserve.models.digits_video.tokenizer import MOTION_WORDS
from training.digits import data as digit_data
from training.digits.data import DIGIT_WORDS, MAX_INTENSITY

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
#: Fraction of training clips that are switch clips (frame 0 shows another digit; module docstring).
SWITCH_PROB = 0.15

#: Motion phrases of the prompts; ``{dir}`` is a direction name.
MOTION_TEMPLATES: tuple[str, ...] = (
    "moving {dir}",
    "going {dir}",
    "sliding {dir}",
    "that moves {dir}",
    "moving to the {dir}",
    "moves {dir}",
)

#: Words that appear in the motion phrases: `diffserve.models.digits_video.tokenizer.MOTION_WORDS`.


@dataclass(frozen=True)
class ClipSpec:
    """What a clip shows: ``digit`` (0..9) moving ``direction`` (one of :data:`DIRECTION_NAMES`)."""

    digit: int
    direction: str


def trajectory(
    direction: str, rng: random.Random, num_frames: int = NUM_FRAMES, canvas: int = CANVAS_SIZE
) -> np.ndarray:
    """Random top-left corners of the digit, one per frame, on a canvas that wraps around.

    The coordinate across the motion is uniform in ``0..canvas-8`` (the digit is whole across
    it); the start along the motion is uniform in ``0..canvas-1``, and the path continues modulo
    ``canvas`` (:func:`render_clip` draws a digit past an edge wrapped around).

    Returns:
        int64 array (num_frames, 2) of (row, column), each in ``0..canvas-1``.

    Raises:
        ValueError: if the canvas is smaller than a digit.
    """
    room = canvas - DIGIT_SIZE
    if room < 0:
        raise ValueError(f"a {canvas}x{canvas} canvas is smaller than a {DIGIT_SIZE}x{DIGIT_SIZE} digit")
    d_row, d_col = DIRECTIONS[direction]
    cross = rng.randint(0, room)
    along = rng.randrange(canvas)
    t = np.arange(num_frames)
    if d_row:
        rows, cols = (along + d_row * SPEED * t) % canvas, np.full(num_frames, cross)
    else:
        rows, cols = np.full(num_frames, cross), (along + d_col * SPEED * t) % canvas
    return np.stack([rows, cols], axis=1).astype(np.int64)


def render_clip(
    digit_image: np.ndarray, corners: np.ndarray, canvas: int = CANVAS_SIZE, first_image: np.ndarray | None = None
) -> np.ndarray:
    """Paste an 8x8 digit at each frame's top-left corner on a black canvas that wraps around.

    Args:
        digit_image: (8, 8) intensities 0..16 (a ``load_digits`` image).
        corners: int (F, 2) top-left (row, column) per frame, from :func:`trajectory`; a digit
            reaching past an edge continues at the opposite edge.
        first_image: (8, 8) image for frame 0 instead of ``digit_image`` (a switch clip), or None.

    Returns:
        float32 (F, canvas, canvas), intensities 0..16.
    """
    frames = np.zeros((len(corners), canvas, canvas), dtype=np.float32)
    for f, (r, c) in enumerate(corners):
        image = first_image if f == 0 and first_image is not None else digit_image
        frames[f, :DIGIT_SIZE, :DIGIT_SIZE] = image
        frames[f] = np.roll(frames[f], (int(r), int(c)), axis=(0, 1))
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


def sample_first_images(
    clip_labels: np.ndarray, images: np.ndarray, labels: np.ndarray, rng: random.Random, prob: float
) -> list[np.ndarray | None]:
    """Frame-0 images of switch clips: with probability ``prob`` a clip gets a random image among
    ``images`` whose label differs from the clip's own, else None (an ordinary clip).

    Args:
        clip_labels: (N,) the digit of each clip (the one its caption names).
        images: (M, 8, 8) the pool to draw frame-0 digits from (the training digits).
        labels: (M,) their labels.

    Returns:
        N entries: an (8, 8) image, or None.
    """
    out: list[np.ndarray | None] = []
    for label in clip_labels:
        if rng.random() < prob:
            others = np.flatnonzero(labels != label)
            out.append(images[others[rng.randrange(len(others))]])
        else:
            out.append(None)
    return out


def make_clips(
    images: np.ndarray,
    specs: list[ClipSpec],
    rng: random.Random,
    num_frames: int = NUM_FRAMES,
    first_images: list[np.ndarray | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Render one clip per (image, spec) pair at random positions.

    Args:
        images: (N, 8, 8) digit images, intensities 0..16.
        specs: N clip specs (their ``digit`` is only carried along; ``images`` decide the pixels).
        first_images: N frame-0 images for switch clips (None entries: ordinary clips), from
            :func:`sample_first_images`; None for no switch clips.

    Returns:
        ``(frames, corners)``: float32 (N, F, 16, 16) intensities 0..16 and int64 (N, F, 2).
    """
    corners = np.stack([trajectory(s.direction, rng, num_frames) for s in specs])
    firsts = first_images if first_images is not None else [None] * len(specs)
    frames = np.stack([render_clip(img, c, first_image=f) for img, c, f in zip(images, corners, firsts)])
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
    :data:`~training.digits.data.TRAIN_TEMPLATES`) with a random :data:`MOTION_TEMPLATES`
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
    "CANVAS_SIZE", "DIGIT_SIZE", "NUM_FRAMES", "FPS", "DIRECTIONS", "DIRECTION_NAMES", "SPEED", "SWITCH_PROB",
    "MOTION_TEMPLATES", "MOTION_WORDS", "DIGIT_WORDS", "ClipSpec", "trajectory", "render_clip",
    "to_model_range", "sample_specs", "sample_first_images", "make_clips", "format_prompt", "sample_training_prompts",
]
