"""Training data and prompt templates for the built-in digits model.

Images come from scikit-learn's bundled copy of the UCI "Optical Recognition of Handwritten
Digits" test set (``sklearn.datasets.load_digits``: 1797 grayscale 8x8 images, integer
intensities 0..16, labels 0..9). No download is involved.

The split is fixed (stratified, 20 % held out, ``random_state=0``) and shared by the trainer
and by the quality judge in ``benchmarks/quality.py``; the held-out part is never trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

#: Maximum pixel intensity in ``load_digits`` images.
MAX_INTENSITY = 16.0
IMAGE_SIZE = 8
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0

DIGIT_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
)

#: Prompt templates used in training; ``{d}`` is the digit ("3"), ``{word}`` its name ("three").
TRAIN_TEMPLATES: tuple[str, ...] = (
    "{d}",
    "{word}",
    "digit {d}",
    "number {word}",
    "a handwritten digit {d}",
    "the number {word}",
    "the digit {word}",
    "handwritten {word}",
    "a picture of the number {d}",
    "an image of a handwritten {word}",
    "a drawing of {word}",
    "a photo of the numeral {d}",
    "draw a {d}",
    "show me a {word}",
    "a small black and white {word}",
    "a single hand written digit {d}",
    "a sketch of number {d}",
    "white {word} on black",
)

#: Templates never used in training; every word is in the tokenizer's vocabulary and appears
#: in some training template, but these combinations are unseen.
HELDOUT_TEMPLATES: tuple[str, ...] = (
    "a drawing of the digit {d}",
    "handwritten number {d}",
    "an image of the numeral {word}",
    "a photo of a handwritten {word}",
    "the handwritten digit {word}",
    "draw the number {word}",
    "a picture of a {word}",
    "show me the digit {d}",
)


def format_prompt(template: str, digit: int) -> str:
    """Fill a template's ``{d}`` and ``{word}`` fields for ``digit`` (0..9).

    Raises:
        IndexError: if ``digit`` is outside 0..9.
    """
    return template.format(d=digit, word=DIGIT_WORDS[digit])


@dataclass(frozen=True)
class DigitSplit:
    """The fixed train / held-out split, in the dataset's original scale.

    Attributes:
        train_images: float64 array (N_train, 8, 8), intensities 0..16 (N_train = 1437).
        train_labels: int64 array (N_train,), digits 0..9.
        heldout_images: float64 array (N_heldout, 8, 8), intensities 0..16 (N_heldout = 360).
        heldout_labels: int64 array (N_heldout,).
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    heldout_images: np.ndarray
    heldout_labels: np.ndarray


@lru_cache(maxsize=1)
def load_split() -> DigitSplit:
    """Load ``sklearn.datasets.load_digits`` and split it 80/20, stratified, ``random_state=0``.

    Returns:
        A :class:`DigitSplit` (cached; treat the arrays as read-only).
    """
    digits = load_digits()
    x_tr, x_ho, y_tr, y_ho = train_test_split(
        digits.images,
        digits.target,
        test_size=HELDOUT_FRACTION,
        stratify=digits.target,
        random_state=SPLIT_SEED,
    )
    for array in (x_tr, x_ho, y_tr, y_ho):
        array.setflags(write=False)
    return DigitSplit(x_tr, y_tr.astype(np.int64), x_ho, y_ho.astype(np.int64))


def to_model_range(images: np.ndarray) -> torch.Tensor:
    """Convert images with intensities 0..16, shape (N, 8, 8), to float32 (N, 1, 8, 8) in [-1, 1]."""
    x = torch.as_tensor(np.asarray(images, dtype=np.float32))
    return (x / (MAX_INTENSITY / 2) - 1.0).unsqueeze(1)


def train_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Training images as float32 (N_train, 1, 8, 8) in [-1, 1] and labels as int64 (N_train,)."""
    split = load_split()
    return to_model_range(split.train_images), torch.as_tensor(split.train_labels)


def heldout_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out images as float32 (N_heldout, 1, 8, 8) in [-1, 1] and labels as int64 (N_heldout,)."""
    split = load_split()
    return to_model_range(split.heldout_images), torch.as_tensor(split.heldout_labels)


def sample_training_prompts(labels: list[int], rng: random.Random, empty_prob: float) -> list[str]:
    """One training prompt per label: a random training template, or ``""`` w.p. ``empty_prob``.

    The empty prompt is the pipeline's default negative prompt, so dropping the caption this way
    trains the unconditional branch used by classifier-free guidance (Ho & Salimans 2022,
    arXiv:2207.12598).
    """
    prompts = []
    for digit in labels:
        if rng.random() < empty_prob:
            prompts.append("")
        else:
            prompts.append(format_prompt(rng.choice(TRAIN_TEMPLATES), int(digit)))
    return prompts
