"""Quality benchmark for the built-in `digits-reasoning` model: does the image show the answer?

Held-out prompts of the model's grammar (``training/digits_reasoning/grammar.py``: known problems
in wordings never trained), cycled to ``--images`` images, image ``k`` with seed ``--seed + k``.
Each image is judged by this project's digit judge (``benchmarks/quality.py``: an RBF SVM on the
digits training split, 99.4 % on held-out real digits) and counted right when the judge reads the
prompt's answer. Also reported: how often the language model's answer (``ar_text``) is right,
and seconds per image.

``--swap-kv``: every request's transferred K/V is replaced by another request's (request ``k``
gets the K/V of request ``perm[k]``, a fixed derangement: with the diffserve backend its AR
stage runs on prompt ``perm[k]``, so the connector hands its DiT stage the LM's K/V of that
prompt and answer). If the DiT really reads the K/V, accuracy falls to about chance (the images
follow the other prompts' answers).

Usage::

    python benchmarks/quality_reasoning.py                    # diffserve engine, 200 images
    python benchmarks/quality_reasoning.py --swap-kv
    python benchmarks/quality_reasoning.py --backend reference # DigitsReasoningPipeline, batches of 50
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # training/ (out of the wheel)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import build_judge, judge_images, record_in_card, write_judge_table  # noqa: E402

from diffserve.models import BUILTIN_MODELS  # noqa: E402
from training.digits_reasoning import grammar  # noqa: E402

DEFAULT_MODEL_PATH = BUILTIN_MODELS["digits-reasoning"]
PACKAGE_MODEL_CARD = DEFAULT_MODEL_PATH.parent / "MODEL_CARD.md"


def heldout_prompts(n: int) -> tuple[list[str], np.ndarray]:
    """``n`` held-out prompts (the held-out split cycled) and their answers (int64 (n,))."""
    held = grammar.split()[1]
    problems = [held[k % len(held)] for k in range(n)]
    return [p.prompt for p in problems], np.asarray([p.answer for p in problems], dtype=np.int64)


def derangement(n: int, seed: int = 0) -> np.ndarray:
    """A fixed permutation of ``range(n)`` without fixed points (a shuffled cycle)."""
    order = np.random.default_rng(seed).permutation(n)
    perm = np.empty(n, dtype=np.int64)
    perm[order] = np.roll(order, 1)
    return perm


@dataclass
class ReasoningReport:
    """Fractions in [0, 1]."""

    accuracy: float
    text_accuracy: float
    per_answer_accuracy: list[float]
    seconds_per_image: float


def generate_reference(model: Path, prompts: list[str], seed: int, steps: int, guidance: float,
                       swap: np.ndarray | None, batch_size: int = 50) -> tuple[np.ndarray, list[str], float]:
    """Images (float (N, 8, 8) in [0, 1]), answers and seconds with `DigitsReasoningPipeline`,
    in batches (each prompt its own generator)."""
    from diffserve.pipelines.ar_context import export_kv
    from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline

    pipe = DigitsReasoningPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    start = time.perf_counter()
    contexts = None
    if swap is not None:
        _, sequences = pipe.generate_answers(prompts)
        kv = export_kv(pipe.language_model, sequences, pipe.tokenizer.pad_token_id)
        contexts = [kv[j] for j in swap]
    images, texts = [], []
    for lo in range(0, len(prompts), batch_size):
        hi = min(lo + batch_size, len(prompts))
        out = pipe(prompts[lo:hi], num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                   generator=[torch.Generator().manual_seed(seed + k) for k in range(lo, hi)],
                   ar_kv=None if contexts is None else contexts[lo:hi])
        images.append(out.images[..., 0])
        texts += out.ar_texts
    return np.concatenate(images), texts, time.perf_counter() - start


def generate_diffserve(model: Path, prompts: list[str], seed: int, steps: int, guidance: float,
                       swap: np.ndarray | None, connector: str = "inprocess",
                       threads: int = 1) -> tuple[np.ndarray, list[str], float]:
    """Images, answers and seconds through diffserve's engine (AR stage + DiT stage, the
    K/V through the connector: ``shared_memory`` runs the AR stage in its own process); with
    `swap`, request ``k``'s AR stage runs on prompt ``swap[k]`` (its DiT stage gets that
    prompt's K/V, and ``ar_text`` is that prompt's answer)."""
    from diffserve import DiffusionEngine, EngineConfig, SamplingParams

    executor = "multiprocess" if connector == "shared_memory" else "inprocess"
    engine = DiffusionEngine(EngineConfig(model=str(model), executor=executor, max_batch_size=64,
                                          num_threads=threads))
    try:
        params = [SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=seed + k, output_type="np")
                  for k in range(len(prompts))]
        if swap is not None:  # the AR stage sees another request's prompt; the DiT stage its own
            submit, order = engine.ar_stage.submit, iter(swap)  # `generate` adds requests in order

            def swapped_submit(request_id, prompt, request_params, on_delta=None):
                return submit(request_id, prompts[next(order)], request_params, on_delta)

            engine.ar_stage.submit = swapped_submit
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        failed = [o.error for o in outputs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
        images = np.stack([np.asarray(o.images)[0, :, :, 0] for o in outputs])
        return images, [o.ar_text for o in outputs], seconds
    finally:
        engine.shutdown()


def evaluate(images: np.ndarray, texts: list[str], answers: np.ndarray, seconds: float) -> ReasoningReport:
    clf, _ = build_judge()
    predicted = judge_images(clf, images)
    per = [float(np.mean(predicted[answers == d] == d)) if np.any(answers == d) else float("nan") for d in range(10)]
    text_right = [t == grammar.DIGIT_WORDS[a] for t, a in zip(texts, answers)]
    return ReasoningReport(float(np.mean(predicted == answers)), float(np.mean(text_right)), per,
                           seconds / len(images))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--backend", choices=["diffserve", "reference"], default="diffserve")
    parser.add_argument("--connector", choices=["inprocess", "shared_memory"], default="inprocess",
                        help="diffserve backend: the KV connector (shared_memory: the AR stage in its own process)")
    parser.add_argument("--swap-kv", action="store_true", help="give every request another request's K/V")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--update-card", action="store_true", help="record the result in the model card")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> ReasoningReport:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts, answers = heldout_prompts(args.images)
    swap = derangement(len(prompts), args.seed) if args.swap_kv else None
    generate = generate_diffserve if args.backend == "diffserve" else generate_reference
    kwargs = {"connector": args.connector, "threads": args.threads} if args.backend == "diffserve" else {}
    images, texts, seconds = generate(args.model, prompts, args.seed, args.steps, args.guidance, swap, **kwargs)
    report = evaluate(images, texts, answers, seconds)
    print(f"model: {args.model}  backend: {args.backend}  threads: {args.threads}  images: {len(images)}  "
          f"steps: {args.steps}  guidance: {args.guidance:g}  swap-kv: {args.swap_kv}")
    print("per-answer accuracy: " + "  ".join(f"{d}:{100 * a:.0f}%" for d, a in enumerate(report.per_answer_accuracy)))
    print(f"judge accuracy (image shows the answer): {100 * report.accuracy:.1f} %")
    print(f"language model answer accuracy: {100 * report.text_accuracy:.1f} %")
    print(f"seconds per image: {report.seconds_per_image:.4f}")
    if args.update_card:
        def update(card: Path, command: str) -> None:
            header = ["Judge: `benchmarks/quality.py`'s digit SVM reads each image; right = it reads the prompt's "
                      "answer. Held-out prompts of the grammar, image k with seed `--seed + k`. `--swap-kv` gives "
                      "each request another request's K/V (the DiT must follow them).", "",
                      "| command | backend | swap K/V | images | steps | guidance | judge accuracy | LM answers right | s/image |",
                      "|---|---|---|---:|---:|---:|---:|---:|---:|"]
            row = (f"| `{command}` | {args.backend} | {'yes' if args.swap_kv else 'no'} | {len(images)} | {args.steps} | "
                   f"{args.guidance:g} | {100 * report.accuracy:.1f} % | {100 * report.text_accuracy:.1f} % | "
                   f"{report.seconds_per_image:.4f} |")
            write_judge_table(card, command, header, row)

        record_in_card("benchmarks/quality_reasoning.py", argv, args.model, DEFAULT_MODEL_PATH, PACKAGE_MODEL_CARD,
                       update)
    return report


if __name__ == "__main__":
    main()
