"""Quality benchmark for the built-in digits model, judged by an independent classifier.

Generates ``--n-per-digit`` images for each digit 0..9 from prompt templates, then reports:

* judge accuracy per digit and overall: an RBF-kernel SVM (scikit-learn ``SVC``) trained on the
  same fixed training split as the model (``training.digits.data``), never on generated
  images; its accuracy on the 360 held-out real images is printed as the ceiling;
* mean seconds per image (wall clock of the generate call / number of images);
* diversity: mean pairwise L2 distance among the samples of one digit divided by the same for
  the held-out real images of that digit, averaged over digits (1.0 = as diverse as real data);
* novelty: median L2 distance from each generated image to its nearest training image, next to
  the same statistic for held-out real images (generated far below real = memorisation).

Distances are on pixels in [0, 1] (8x8 images, so at most 8).

Usage::

    python benchmarks/quality.py                              # diffserve engine, built-in model
    python benchmarks/quality.py --templates heldout --steps 8
    python benchmarks/quality.py --backend diffusers          # reference arm: plain diffusers
    python benchmarks/quality.py --lora mirror --update-card  # the built-in mirror LoRA's judge

``--backend diffserve`` (default) generates through ``diffserve.DiffusionEngine``;
``--backend diffusers`` through ``diffusers.StableDiffusion3Pipeline`` with the same prompts and
seeds (image ``k`` uses seed ``--seed + k``).

``--quantization none,int8_weight_only,int8_dynamic`` (diffserve backend) runs each arm on the
same prompts and seeds in one process (the first arm is the baseline) and reports, per arm, the
judge accuracy, its difference from the baseline's in points, and the PSNR of its images
against the baseline's (dB, pixels in [0, 1]); ``--quantization-skip`` applies to every
quantized arm.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from sklearn.svm import SVC

#: training/ (the built-in models' data and judges' helpers) lives at the repository root, outside the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffserve.models.digits import DEFAULT_MODEL_PATH  # noqa: E402
from training.digits import data  # noqa: E402
from training.digits.train import PACKAGE_MODEL_CARD  # noqa: E402
from training.common import QUALITY_BEGIN, QUALITY_END  # noqa: E402

#: Judge hyper-parameters (chosen on the held-out split: 99.4 % accuracy).
JUDGE_C = 5.0
#: ``--templates`` choices: which of the image model's prompt templates to use.
TEMPLATE_SETS = ("train", "heldout", "both")


def templates_for(name: str) -> tuple[str, ...]:
    """The prompt templates of a ``--templates`` choice (see :data:`TEMPLATE_SETS`).

    Raises:
        KeyError: for any other name.
    """
    return {
        "train": data.TRAIN_TEMPLATES,
        "heldout": data.HELDOUT_TEMPLATES,
        "both": data.TRAIN_TEMPLATES + data.HELDOUT_TEMPLATES,
    }[name]


def _dataset_pixels(images: np.ndarray) -> np.ndarray:
    """``load_digits`` images (N, 8, 8), intensities 0..16 -> float64 (N, 64) pixels in [0, 1]."""
    return images.reshape(len(images), -1) / data.MAX_INTENSITY


def build_judge() -> tuple[SVC, float]:
    """Fit the judge on the training split of ``load_digits`` (about 0.05 s).

    Returns:
        ``(classifier, held-out accuracy)``. The classifier takes float arrays (N, 64) of pixels
        in [0, 1] (dataset intensities / 16); use :func:`judge_images` rather than calling it.
    """
    split = data.load_split()
    clf = SVC(C=JUDGE_C, gamma="scale").fit(_dataset_pixels(split.train_images), split.train_labels)
    accuracy = float(np.mean(clf.predict(_dataset_pixels(split.heldout_images)) == split.heldout_labels))
    return clf, accuracy


def _as_pixels(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) or (N, 8, 8, 1) images in [0, 1] -> float64 (N, 64).

    Raises:
        ValueError: on any other shape.
    """
    images = np.asarray(images, dtype=np.float64)
    if images.ndim == 4 and images.shape[-1] == 1:
        images = images[..., 0]
    if images.ndim != 3 or images.shape[1:] != (data.IMAGE_SIZE, data.IMAGE_SIZE):
        raise ValueError(f"expected images of shape (N, 8, 8[, 1]), got {images.shape}")
    return images.reshape(len(images), -1)


def judge_images(clf: SVC, images: np.ndarray) -> np.ndarray:
    """Classify generated images.

    Args:
        clf: the judge from :func:`build_judge`.
        images: float array (N, 8, 8) or (N, 8, 8, 1), pixels in [0, 1] (0 = background),
            e.g. a pipeline's ``output_type="np"`` output.

    Returns:
        int64 array (N,) of predicted digits.

    Raises:
        ValueError: if ``images`` has another shape.
    """
    return clf.predict(_as_pixels(images)).astype(np.int64)


def make_prompts(templates: tuple[str, ...], n_per_digit: int) -> tuple[list[str], np.ndarray]:
    """``n_per_digit`` prompts per digit, cycling through ``templates``.

    Returns:
        ``(prompts, labels)``: 10 * n_per_digit prompts grouped by digit, and int64 labels.
    """
    prompts, labels = [], []
    for digit in range(10):
        for i in range(n_per_digit):
            prompts.append(data.format_prompt(templates[i % len(templates)], digit))
            labels.append(digit)
    return prompts, np.asarray(labels, dtype=np.int64)


def generate_diffserve(
    model: Path | None, prompts: list[str], seed: int, steps: int, guidance: float, **engine_options
) -> tuple[np.ndarray, float]:
    """Generate one 8x8 image per prompt through diffserve's engine (`engine_options`: more
    `EngineConfig` fields, e.g. ``quantization``).

    Returns:
        ``(images, seconds)``: float32 (N, 8, 8) in [0, 1]; wall-clock seconds of the generate call.

    Raises:
        ImportError: if ``diffserve.DiffusionEngine`` is not available.
    """
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams

    engine = DiffusionEngine(EngineConfig(model=None if model is None else str(model), **engine_options))
    params = [
        SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=seed + k,
                       height=data.IMAGE_SIZE, width=data.IMAGE_SIZE, output_type="np")
        for k in range(len(prompts))
    ]
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    images = np.stack([np.asarray(out.images)[0, :, :, 0] for out in outputs])
    return images, seconds


def generate_diffusers(
    model: Path | None, prompts: list[str], seed: int, steps: int, guidance: float, batch_size: int = 100,
    loras: list[dict[str, float] | None] | None = None,
) -> tuple[np.ndarray, float]:
    """Generate one 8x8 image per prompt with diffusers' ``StableDiffusion3Pipeline`` (reference arm).

    Image ``k`` uses ``torch.Generator().manual_seed(seed + k)``. `loras`: per prompt, built-in
    LoRA adapters by name (`diffserve.models.BUILTIN_LORAS`) set with ``set_adapters`` (prompts
    with the same adapters run in batches together).

    Returns:
        ``(images, seconds)``: float32 (N, 8, 8) in [0, 1]; wall-clock seconds of the pipeline calls.
    """
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(
        model or DEFAULT_MODEL_PATH, text_encoder_3=None, tokenizer_3=None
    )
    pipe.set_progress_bar_config(disable=True)

    def call(batch: list[str], generators: list[torch.Generator]) -> np.ndarray:
        out = pipe(batch, height=data.IMAGE_SIZE, width=data.IMAGE_SIZE, num_inference_steps=steps,
                   guidance_scale=guidance, generator=generators, output_type="np")
        return out.images[..., 0]

    if not loras or not any(loras):
        return generate_in_batches(call, prompts, seed, batch_size)
    from diffserve.models import BUILTIN_LORAS

    for name in {n for spec in loras if spec for n in spec}:
        pipe.load_lora_weights(str(BUILTIN_LORAS["digits"][name]), adapter_name=name)
    images, seconds = np.zeros((len(prompts), data.IMAGE_SIZE, data.IMAGE_SIZE), np.float32), 0.0
    for spec in {tuple(sorted((l or {}).items())) for l in loras}:
        members = [k for k, l in enumerate(loras) if tuple(sorted((l or {}).items())) == spec]
        if spec:
            pipe.enable_lora()
            pipe.set_adapters([n for n, _ in spec], [w for _, w in spec])
        else:
            pipe.disable_lora()
        for lo in range(0, len(members), batch_size):
            chunk = members[lo:lo + batch_size]
            generators = [torch.Generator().manual_seed(seed + k) for k in chunk]
            start = time.perf_counter()
            images[chunk] = call([prompts[k] for k in chunk], generators)
            seconds += time.perf_counter() - start
    return images, seconds


def generate_in_batches(
    call: Callable[[list[str], list[torch.Generator]], np.ndarray], prompts: list[str], seed: int, batch_size: int
) -> tuple[np.ndarray, float]:
    """Run a diffusers pipeline over ``prompts`` in batches of at most ``batch_size``.

    Args:
        call: ``(prompts, generators) -> outputs`` (one output per prompt along axis 0); prompt
            ``k`` of the whole list gets ``torch.Generator().manual_seed(seed + k)``.

    Returns:
        ``(outputs concatenated along axis 0, wall-clock seconds spent in call)``.
    """
    chunks, seconds = [], 0.0
    for lo in range(0, len(prompts), batch_size):
        batch = prompts[lo : lo + batch_size]
        generators = [torch.Generator().manual_seed(seed + lo + k) for k in range(len(batch))]
        start = time.perf_counter()
        chunks.append(call(batch, generators))
        seconds += time.perf_counter() - start
    return np.concatenate(chunks), seconds


def _pairwise_mean(x: np.ndarray) -> float:
    """Mean L2 distance over distinct pairs of rows of x (N, D); requires N >= 2."""
    d = np.sqrt(np.maximum(((x[:, None, :] - x[None, :, :]) ** 2).sum(-1), 0.0))
    n = len(x)
    return float(d.sum() / (n * (n - 1)))


def _nearest(x: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """L2 distance from each row of x (N, D) to its nearest row of ref (M, D), shape (N,)."""
    d2 = (x**2).sum(1)[:, None] - 2 * x @ ref.T + (ref**2).sum(1)[None, :]
    return np.sqrt(np.maximum(d2.min(1), 0.0))


def diversity_and_novelty(pixels: np.ndarray, labels: np.ndarray) -> tuple[float, float, float]:
    """Diversity and novelty of generated digit images against the real ones.

    Args:
        pixels: float (N, 64) generated images, pixels in [0, 1].
        labels: int (N,) the digit each image should show.

    Returns:
        ``(diversity ratio, novelty of the generated, novelty of held-out real)``: the mean over
        digits with at least two images of (mean pairwise L2 distance of the digit's images /
        the same for the held-out real images of that digit), NaN if no digit has two; and the
        median L2 distance to the nearest training image of the generated and of the held-out
        real images.
    """
    split = data.load_split()
    real = _dataset_pixels(split.heldout_images)
    train = _dataset_pixels(split.train_images)
    ratios = [
        _pairwise_mean(pixels[labels == d]) / _pairwise_mean(real[split.heldout_labels == d])
        for d in range(10) if (labels == d).sum() >= 2
    ]
    return (
        float(np.mean(ratios)) if ratios else float("nan"),
        float(np.median(_nearest(pixels, train))),
        float(np.median(_nearest(real, train))),
    )


@dataclass
class QualityReport:
    """Results of one benchmark run (accuracies are fractions in [0, 1])."""

    judge_heldout_accuracy: float
    accuracy: float
    per_digit_accuracy: list[float]
    seconds_per_image: float
    diversity_ratio: float
    novelty_generated: float
    novelty_real: float


def evaluate(clf: SVC, judge_accuracy: float, images: np.ndarray, labels: np.ndarray, seconds: float) -> QualityReport:
    """Score generated images (float (N, 8, 8) in [0, 1]) whose intended digits are ``labels`` (N,).

    Diversity needs at least two images per digit (otherwise it is reported as NaN).
    """
    pixels = _as_pixels(images)
    predicted = judge_images(clf, images)
    per_digit = [float(np.mean(predicted[labels == d] == d)) for d in range(10)]
    diversity, novelty_generated, novelty_real = diversity_and_novelty(pixels, labels)
    return QualityReport(
        judge_heldout_accuracy=judge_accuracy,
        accuracy=float(np.mean(predicted == labels)),
        per_digit_accuracy=per_digit,
        seconds_per_image=seconds / len(images),
        diversity_ratio=diversity,
        novelty_generated=novelty_generated,
        novelty_real=novelty_real,
    )


def update_card(card: Path, command: str, args: argparse.Namespace, report: QualityReport) -> None:
    """Insert or replace this run's row in the judge table between the card's quality markers.

    Raises:
        ValueError: if the card has no quality markers.
    """
    header = [
        f"Judge: RBF SVM (`SVC(C={JUDGE_C}, gamma='scale')`) on the training split; "
        f"held-out real-image accuracy {100 * report.judge_heldout_accuracy:.1f} %. "
        "Diversity: mean pairwise distance of samples of a digit / same for held-out real digits. "
        "Novelty: median distance to the nearest training image (generated vs held-out real). "
        "Produced by `benchmarks/quality.py`; seeds are `--seed + k` for image k.",
        "",
        "| command | backend | templates | steps | guidance | images | accuracy | worst digit | diversity | novelty gen / real | s/image |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    row = (
        f"| `{command}` | {args.backend} | {args.templates} | {args.steps} | {args.guidance:g} | "
        f"{10 * args.n_per_digit} | {100 * report.accuracy:.1f} % | {worst_digit(report.per_digit_accuracy)} | "
        f"{report.diversity_ratio:.2f} | {report.novelty_generated:.2f} / {report.novelty_real:.2f} | "
        f"{report.seconds_per_image:.4f} |"
    )
    write_judge_table(card, command, header, row)


def worst_digit(per_digit_accuracy: list[float]) -> str:
    """Judge-table cell for the digit with the lowest accuracy (fractions; NaN = not generated):
    ``"3 (85 %)"``, or ``"none"`` when even the worst is always right."""
    worst = int(np.nanargmin(per_digit_accuracy))
    return f"{worst} ({100 * per_digit_accuracy[worst]:.0f} %)" if per_digit_accuracy[worst] < 1 else "none"


def write_judge_table(card: Path, command: str, header: list[str], row: str) -> None:
    """Rewrite the judge section between the card's quality markers as ``header`` followed by
    its earlier rows (lines starting with ``| `...``), the row of ``command`` replaced by ``row``
    (appended last).

    Raises:
        ValueError: if the card has no quality markers.
    """
    text = card.read_text()
    match = re.search(re.escape(QUALITY_BEGIN) + r"\n(.*?)" + re.escape(QUALITY_END), text, re.S)
    if match is None:
        raise ValueError(f"{card} has no {QUALITY_BEGIN} ... {QUALITY_END} section")
    rows = [line for line in match.group(1).splitlines() if line.startswith("| `")]
    rows = [r for r in rows if not r.startswith(f"| `{command}` |")] + [row]
    card.write_text(text[: match.start(1)] + "\n".join(header + rows) + "\n" + text[match.end(1) :])


def record_in_card(
    script: str,
    argv: list[str] | None,
    model: Path | None,
    default_model: Path,
    package_card: Path,
    update: Callable[[Path, str], None],
) -> Path:
    """Record a run for ``--update-card``: ``update(card, command)``, then print where.

    ``card`` is ``package_card`` for the built-in model (``model`` None or ``default_model``),
    else ``model / "MODEL_CARD.md"``; ``command`` (naming the run's row) is ``python SCRIPT ARGS``
    without ``--update-card`` (``sys.argv`` when ``argv`` is None), shell-quoted.

    Returns:
        The card's path.
    """
    builtin = model is None or model.resolve() == default_model
    card = package_card if builtin else model / "MODEL_CARD.md"
    command = f"python {script} " + shlex.join(
        [a for a in (sys.argv[1:] if argv is None else argv) if a != "--update-card"]
    )
    update(card, command.strip())
    print(f"recorded in {card}")
    return card


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads`` and ``--update-card`` (see :func:`record_in_card`)."""
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--update-card", action="store_true",
                        help="record the result in the model's card: the package MODEL_CARD.md for the "
                        "built-in model, else MODEL/MODEL_CARD.md")


#: Digits whose left-right mirror images the judge mostly reads as another digit (real held-out
#: digits mirrored read as themselves < 30 % of the time); 0, 1, 4, 8 and 9 stay legible mirrored.
ASYMMETRIC_DIGITS = (2, 3, 5, 6, 7)


@dataclass
class MirrorReport:
    """The `mirror` LoRA's judge numbers (fractions in [0, 1]).

    Attributes:
        mirrored_back: images read as the prompted digit once mirrored back left to right.
        unmirrored / unmirrored_asymmetric: read as the prompted digit as generated (all digits;
            `ASYMMETRIC_DIGITS` only).
        per_digit_mirrored_back / per_digit_unmirrored: the same per digit 0..9.
        without: accuracy of the same prompts and seeds without the adapter, run in the same
            engine and the same step batches as the adapter's requests.
        real_unmirrored / real_unmirrored_asymmetric: held-out real digits mirrored, read as
            themselves (what a perfect mirror would score unmirrored).
    """

    mirrored_back: float
    unmirrored: float
    unmirrored_asymmetric: float
    per_digit_mirrored_back: list[float]
    per_digit_unmirrored: list[float]
    without: float
    real_unmirrored: float
    real_unmirrored_asymmetric: float
    seconds_per_image: float


def evaluate_mirror(clf: SVC, styled: np.ndarray, plain: np.ndarray, labels: np.ndarray,
                    seconds: float) -> MirrorReport:
    """Score the `mirror` adapter's images `styled` and the same prompts' images `plain`
    (float (N, 8, 8) in [0, 1]) whose intended digits are ``labels``."""
    back = judge_images(clf, styled[:, :, ::-1].copy())
    raw = judge_images(clf, styled)
    asym = np.isin(labels, ASYMMETRIC_DIGITS)
    split = data.load_split()
    real = split.heldout_images[:, :, ::-1] / data.MAX_INTENSITY
    real_pred = judge_images(clf, np.ascontiguousarray(real))
    real_asym = np.isin(split.heldout_labels, ASYMMETRIC_DIGITS)
    return MirrorReport(
        mirrored_back=float(np.mean(back == labels)),
        unmirrored=float(np.mean(raw == labels)),
        unmirrored_asymmetric=float(np.mean(raw[asym] == labels[asym])),
        per_digit_mirrored_back=[float(np.mean(back[labels == d] == d)) for d in range(10)],
        per_digit_unmirrored=[float(np.mean(raw[labels == d] == d)) for d in range(10)],
        without=float(np.mean(judge_images(clf, plain) == labels)),
        real_unmirrored=float(np.mean(real_pred == split.heldout_labels)),
        real_unmirrored_asymmetric=float(np.mean(real_pred[real_asym] == split.heldout_labels[real_asym])),
        seconds_per_image=seconds / (2 * len(labels)),
    )


def update_mirror_card(card: Path, command: str, args: argparse.Namespace, report: MirrorReport) -> None:
    """Insert or replace this run's row in the LoRA card's judge table."""
    header = [
        f"Judge: the digits model's (`SVC(C={JUDGE_C}, gamma='scale')` on the training split). Each prompt runs "
        "twice in one engine, with and without the adapter (same seeds; the requests share step batches). "
        "\"Mirrored back\": images flipped left to right before judging. \"Real\": held-out real digits "
        f"mirrored, read as themselves (what a perfect mirror scores unmirrored). Asymmetric digits: "
        f"{', '.join(map(str, ASYMMETRIC_DIGITS))}. Produced by `benchmarks/quality.py --lora mirror`.",
        "",
        "| command | backend | steps | guidance | images | mirrored back | worst digit | unmirrored (all / asymmetric) "
        "| real mirrored, unmirrored (all / asymmetric) | without the adapter | s/image |",
        "|---|---|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    row = (
        f"| `{command}` | {args.backend} | {args.steps} | {args.guidance:g} | {10 * args.n_per_digit} | "
        f"{100 * report.mirrored_back:.1f} % | {worst_digit(report.per_digit_mirrored_back)} | "
        f"{100 * report.unmirrored:.1f} % / {100 * report.unmirrored_asymmetric:.1f} % | "
        f"{100 * report.real_unmirrored:.1f} % / {100 * report.real_unmirrored_asymmetric:.1f} % | "
        f"{100 * report.without:.1f} % | {report.seconds_per_image:.4f} |"
    )
    write_judge_table(card, command, header, row)


def run_mirror(args: argparse.Namespace, argv: list[str] | None, clf: SVC) -> MirrorReport:
    """``--lora mirror``: judge the built-in `mirror` adapter (see `MirrorReport`)."""
    from diffserve.models import BUILTIN_LORAS

    templates = templates_for(args.templates)
    prompts, labels = make_prompts(templates, args.n_per_digit)
    loras = [{"mirror": 1.0}] * len(prompts) + [None] * len(prompts)
    images, seconds = _generate_arms(args, prompts + prompts, loras)
    report = evaluate_mirror(clf, images[:len(prompts)], images[len(prompts):], labels, seconds)
    print(f"mirror LoRA: mirrored back {100 * report.mirrored_back:.1f} %, unmirrored {100 * report.unmirrored:.1f} % "
          f"(asymmetric digits {100 * report.unmirrored_asymmetric:.1f} %), without the adapter "
          f"{100 * report.without:.1f} %")
    print("per digit, mirrored back: " + "  ".join(f"{d}:{100 * a:.0f}%"
                                                  for d, a in enumerate(report.per_digit_mirrored_back)))
    print("per digit, unmirrored:    " + "  ".join(f"{d}:{100 * a:.0f}%"
                                                  for d, a in enumerate(report.per_digit_unmirrored)))
    print(f"real held-out digits mirrored, read unmirrored: {100 * report.real_unmirrored:.1f} % "
          f"(asymmetric {100 * report.real_unmirrored_asymmetric:.1f} %)")
    if args.update_card:
        card = BUILTIN_LORAS["digits"]["mirror"] / "LORA_CARD.md"
        command = "python benchmarks/quality.py " + shlex.join(
            [a for a in (sys.argv[1:] if argv is None else argv) if a != "--update-card"])
        update_mirror_card(card, command.strip(), args, report)
        print(f"recorded in {card}")
    return report


def _generate_arms(args, prompts: list[str], loras: list) -> tuple[np.ndarray, float]:
    """The adapter's arm (first half of `prompts`) and the plain arm (second half); image k of
    each arm uses seed ``args.seed + k``. diffserve runs both in one engine call (their requests
    share step batches)."""
    half = len(prompts) // 2
    if args.backend == "diffserve":
        from diffserve import DiffusionEngine, EngineConfig, SamplingParams

        engine = DiffusionEngine(EngineConfig(model=None if args.model is None else str(args.model)))
        params = [SamplingParams(num_inference_steps=args.steps, guidance_scale=args.guidance,
                                 seed=args.seed + k % half, height=data.IMAGE_SIZE, width=data.IMAGE_SIZE,
                                 output_type="np", loras=loras[k]) for k in range(len(prompts))]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        return np.stack([np.asarray(out.images)[0, :, :, 0] for out in outputs]), seconds
    styled, s1 = generate_diffusers(args.model, prompts[:half], args.seed, args.steps, args.guidance,
                                    loras=loras[:half])
    plain, s2 = generate_diffusers(args.model, prompts[half:], args.seed, args.steps, args.guidance)
    return np.concatenate([styled, plain]), s1 + s2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments (see module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-per-digit", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="pipeline folder (default: built-in)")
    parser.add_argument("--templates", choices=TEMPLATE_SETS, default="both")
    parser.add_argument("--backend", choices=["diffserve", "diffusers"], default="diffserve")
    parser.add_argument("--lora", choices=["mirror"], default=None,
                        help="judge the built-in model's LoRA adapter instead (mirror: images are judged mirrored "
                             "back; --update-card writes its LORA_CARD.md)")
    parser.add_argument("--quantization", default=None, metavar="ARMS",
                        help="comma-separated quantization arms (none = unquantized; the first is the baseline)")
    parser.add_argument("--quantization-skip", default=None, help="EngineConfig.quantization_skip for every arm")
    add_run_arguments(parser)
    return parser.parse_args(argv)


def psnr(images: np.ndarray, reference: np.ndarray) -> float:
    """PSNR in dB of images against `reference`, pixels in [0, 1] (inf when identical)."""
    mse = float(np.mean((np.asarray(images, np.float64) - np.asarray(reference, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(1.0 / mse))


def compare_quantization(args: argparse.Namespace, clf: SVC, judge_accuracy: float, prompts: list[str],
                         labels: np.ndarray) -> dict[str, QualityReport]:
    """Run each ``--quantization`` arm (see the module docstring) and print one line per arm."""
    reports, baseline = {}, None
    for arm in [a.strip() for a in args.quantization.split(",") if a.strip()]:
        method = None if arm in ("none", "fp32") else arm
        skip = args.quantization_skip if method is not None else None
        images, seconds = generate_diffserve(args.model, prompts, args.seed, args.steps, args.guidance,
                                             quantization=method, quantization_skip=skip)
        report = reports[arm] = evaluate(clf, judge_accuracy, images, labels, seconds)
        if baseline is None:
            baseline = (images, report)
        delta = 100 * (report.accuracy - baseline[1].accuracy)
        print(f"arm {arm:18s} accuracy {100 * report.accuracy:6.2f} %  vs baseline {delta:+.2f} points  "
              f"PSNR vs baseline {psnr(images, baseline[0]):6.2f} dB  worst digit "
              f"{worst_digit(report.per_digit_accuracy)}  s/image {report.seconds_per_image:.4f}", flush=True)
    return reports


def main(argv: list[str] | None = None) -> QualityReport | MirrorReport:
    """Run the benchmark and print the report; see :func:`parse_args`."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    templates = templates_for(args.templates)
    start = time.perf_counter()
    clf, judge_accuracy = build_judge()
    print(f"judge: SVC(C={JUDGE_C}, gamma='scale'), held-out real accuracy {100 * judge_accuracy:.2f} % "
          f"(built in {time.perf_counter() - start:.2f} s)")
    if args.lora == "mirror":
        return run_mirror(args, argv, clf)
    prompts, labels = make_prompts(templates, args.n_per_digit)
    if args.quantization:
        if args.backend != "diffserve" or args.update_card:
            raise SystemExit("--quantization runs the diffserve backend and records nothing in the card")
        print(f"images: {len(prompts)}  steps: {args.steps}  guidance: {args.guidance:g}  threads: {args.threads}")
        reports = compare_quantization(args, clf, judge_accuracy, prompts, labels)
        return next(iter(reports.values()))
    generate = generate_diffserve if args.backend == "diffserve" else generate_diffusers
    images, seconds = generate(args.model, prompts, args.seed, args.steps, args.guidance)
    report = evaluate(clf, judge_accuracy, images, labels, seconds)

    print(f"model: {args.model or DEFAULT_MODEL_PATH}  backend: {args.backend}  threads: {args.threads}")
    print(f"templates: {args.templates}  steps: {args.steps}  guidance: {args.guidance:g}  "
          f"images: {len(images)}  seed: {args.seed}")
    print("per-digit accuracy: " + "  ".join(f"{d}:{100 * a:.0f}%" for d, a in enumerate(report.per_digit_accuracy)))
    print(f"overall judge accuracy: {100 * report.accuracy:.2f} %")
    print(f"mean seconds per image: {report.seconds_per_image:.4f}")
    print(f"diversity ratio (generated / real held-out): {report.diversity_ratio:.3f}")
    print(f"novelty (median distance to nearest training image): generated {report.novelty_generated:.3f}, "
          f"real held-out {report.novelty_real:.3f}")
    if args.update_card:
        record_in_card("benchmarks/quality.py", argv, args.model, DEFAULT_MODEL_PATH, PACKAGE_MODEL_CARD,
                       lambda card, command: update_card(card, command, args, report))
    return report


if __name__ == "__main__":
    main()
