"""Image-to-image on the built-in digits model: does an edit follow the prompt, and does a
light edit stay close to its input?

Inputs are the HELD-OUT scikit-learn images of one digit (never trained on); each is edited
with a prompt naming another digit, at several strengths, one seed per input. The judge
(`benchmarks/quality.py`'s SVC, 99.4 % on held-out digits) reads the result; the pixel distance
is the mean absolute difference to the input on a 0..1 scale.

Usage:
    python benchmarks/quality_img2img.py                          # 3 -> "the number eight"
    python benchmarks/quality_img2img.py --source 1 --target 7 --strengths 0.2 0.5 0.9
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from quality import build_judge, judge_images  # puts the repository root (training/) on sys.path

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from training.digits import data


@dataclass
class StrengthResult:
    """Results at one strength: fraction judged the target digit, fraction still judged the
    source digit, mean absolute pixel distance to the input (0..1 scale), and seconds."""

    strength: float
    target_accuracy: float
    source_kept: float
    pixel_distance: float
    seconds: float


def source_images(digit: int, count: int) -> np.ndarray:
    """Up to `count` held-out images of `digit` as float (N, 8, 8) in [0, 1]."""
    split = data.load_split()
    images = split.heldout_images[split.heldout_labels == digit] / data.MAX_INTENSITY
    reps = -(-count // len(images))
    return np.concatenate([images] * reps)[:count].astype(np.float32)


def reference_distances(source: int, target: int) -> tuple[float, float]:
    """Mean absolute pixel distance (0..1) between different held-out images of `source`, and
    between held-out `source` and `target` images: the scale a distance is read against."""
    split = data.load_split()
    a = split.heldout_images[split.heldout_labels == source] / data.MAX_INTENSITY
    b = split.heldout_images[split.heldout_labels == target] / data.MAX_INTENSITY
    same = np.abs(a[:, None] - a[None]).mean(axis=(2, 3))
    same = same[~np.eye(len(a), dtype=bool)].mean()
    other = np.abs(a[:, None] - b[None]).mean()
    return float(same), float(other)


def run(source: int, target: int, strengths: list[float], count: int, steps: int | None,
        guidance: float | None, threads: int) -> list[StrengthResult]:
    """Edit `count` held-out images of `source` towards "the number <target>" at each
    strength with the built-in model (one seed per input image)."""
    torch.set_num_threads(threads)
    clf, _ = build_judge()
    engine = DiffusionEngine(EngineConfig(default_seed=0))
    inputs = source_images(source, count)
    prompt = data.format_prompt("the number {word}", target)
    results = []
    for strength in strengths:
        params = [SamplingParams(seed=i, strength=strength, num_inference_steps=steps,
                                 guidance_scale=guidance, output_type="np") for i in range(count)]
        start = time.perf_counter()
        outs = engine.generate([prompt] * count, params, inputs=[x for x in inputs])
        seconds = time.perf_counter() - start
        assert all(o.ok for o in outs), [o.error for o in outs if not o.ok][:1]
        images = np.concatenate([o.images for o in outs])[..., 0]
        predicted = judge_images(clf, images)
        results.append(StrengthResult(
            strength=strength,
            target_accuracy=float(np.mean(predicted == target)),
            source_kept=float(np.mean(predicted == source)),
            pixel_distance=float(np.abs(images - inputs).mean()),
            seconds=seconds,
        ))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=int, default=3)
    ap.add_argument("--target", type=int, default=8)
    ap.add_argument("--strengths", type=float, nargs="+", default=[0.2, 0.5, 0.7, 0.9])
    ap.add_argument("--count", type=int, default=50, help="input images (one seed each)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--guidance", type=float, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    results = run(args.source, args.target, args.strengths, args.count, args.steps, args.guidance, args.threads)
    same, other = reference_distances(args.source, args.target)
    print(f"{args.count} held-out {args.source}s edited with 'the number {args.target}' "
          f"(threads={args.threads}):")
    print(f"{'strength':>8} {'judged ' + str(args.target):>10} {'still ' + str(args.source):>8} "
          f"{'pixel dist':>10} {'seconds':>8}")
    for r in results:
        print(f"{r.strength:8.2f} {r.target_accuracy:10.1%} {r.source_kept:8.1%} {r.pixel_distance:10.3f} "
              f"{r.seconds:8.2f}")
    print(f"reference pixel distances: another held-out {args.source} {same:.3f}, a held-out {args.target} {other:.3f}")
    print(json.dumps({"results": [asdict(r) for r in results], "same_digit_distance": same,
                      "target_digit_distance": other}))


if __name__ == "__main__":
    main()
