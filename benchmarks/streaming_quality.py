"""Streaming quality on the built-in video model (moving digits): the interaction judge check and
seam continuity, everything generated through diffserve's engine (streams batched together).

Interaction check (issue 12): a stream of ``--chunks`` (4) chunks starts with "a handwritten digit
3 moving right"; when its chunk 0 is emitted, ``submit_interaction`` changes the prompt to "a
handwritten digit 8 moving right" with ``transition_chunks=1``: chunks 0-1 use the 3 prompt,
chunk 2 is the halfway blend (the transition chunk) and chunk 3 the 8 prompt. A chunk *reads d*
when d is the digit the judge (``benchmarks/quality_video.py``'s per-frame ``judge_frames``)
finds most often among the chunk's frames. A seed passes when chunks 0 and 1 read 3 and every
chunk after the transition reads 8. Reference in the same run, same seeds: ordinary one-chunk
clips of each prompt, and how often one reads its digit (what one chunk can be expected to do).

Seam continuity, on streams without interaction ("3 moving right"): the digit's column
(circular centre of mass of the pixels brighter than the judge's threshold) in every frame; |dx| between
consecutive frames inside chunks vs across each seam (a chunk's last frame -> the next chunk's
first new frame), and the mean signed dx (the training clips move +1 px/frame to the right),
plus the mean absolute pixel change between consecutive frames. Arms: the stream (each chunk
conditioned on the previous one's last frame), independent chunks (ordinary clips of the same
prompt, each without its first frame after the first clip, as a stream emits them), and a single
long generation with as many frames (its frames at the seam positions vs the others).

Usage::

    python benchmarks/streaming_quality.py                  # 50 seeds, 4 chunks, built-in model
    python benchmarks/streaming_quality.py --seeds 10 --steps 8

Seeds are ``--seed + k`` for stream k (independent chunk j of stream k: seed
``--seed + 1000 * (j + 1) + k``). Prints one line per measure and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import build_judge  # noqa: E402
from quality_video import displacements, judge_frames  # noqa: E402

from diffserve import DiffusionEngine, EngineConfig, EventType, SamplingParams  # noqa: E402
from diffserve.models.digits_video import DEFAULT_MODEL_PATH  # noqa: E402

FIRST = "a handwritten digit 3 moving right"
SECOND = "a handwritten digit 8 moving right"


def gray(frames: np.ndarray) -> np.ndarray:
    """uint8 (F, H, W, 3) -> float64 (F, H, W) in [0, 1]."""
    return frames.astype(np.float64).mean(-1) / 255.0


def reads(clf, frames: np.ndarray) -> int:
    """The digit the judge finds most often among `frames` (uint8 (F, H, W, 3))."""
    digits, _ = judge_frames(clf, gray(frames)[None])
    return int(np.bincount(digits[0], minlength=10).argmax())


def seam_stats(videos: list[np.ndarray], seams: list[int]) -> dict[str, float]:
    """|dx|, signed dx and mean |pixel change| between frames i-1 and i, for i in `seams`
    (first frames of chunks after the first) vs every other i. dx is the column displacement of
    the digit's circular centre of mass (``quality_video.displacements``: the canvas wraps
    around, so a digit crossing the edge moves +1, not -15)."""
    at, within = {"abs_dx": [], "dx": [], "pixel": []}, {"abs_dx": [], "dx": [], "pixel": []}
    for video in videos:
        g = gray(video)
        dx = displacements(g)[:, 1]
        for i in range(1, len(video)):
            bucket = at if i in seams else within
            if np.isfinite(dx[i - 1]):
                bucket["abs_dx"].append(abs(dx[i - 1]))
                bucket["dx"].append(dx[i - 1])
            bucket["pixel"].append(float(np.abs(g[i] - g[i - 1]).mean()))
    out = {}
    for name, bucket in (("seam", at), ("within", within)):
        for key, values in bucket.items():
            out[f"{name}_{key}"] = float(np.mean(values)) if values else float("nan")
    return out


def run_streams(engine: DiffusionEngine, seeds: list[int], params: dict, chunks: int,
                interaction: dict | None) -> dict[int, dict]:
    """One stream per seed, batched; with `interaction`, sent from each stream's chunk-0 event.
    Returns per seed ``{"chunks": [frames...], "event_ids": [...], "video": frames}``."""
    results: dict[int, dict] = {}

    def listener_for(seed: int):
        def on_event(event):
            r = results[seed]
            if event.type is EventType.CHUNK:
                r["chunks"].append(event.output)
                r["event_ids"].append(list(event.event_ids))
                if event.chunk_index == 0 and interaction is not None:
                    engine.submit_interaction(event.request_id, {**interaction, "event_id": f"update-{seed}"})
            elif event.type.is_final:
                assert event.output.ok, event.output.error
                r["video"] = event.output.videos[0]
                r["metrics"] = event.output.metrics
        return on_event

    for seed in seeds:
        results[seed] = {"chunks": [], "event_ids": []}
        engine.add_request(FIRST, SamplingParams(seed=seed, num_chunks=chunks, output_type="np", **params),
                           listener=listener_for(seed))
    while engine.has_unfinished_requests():
        engine.step()
    return results


def clips(engine: DiffusionEngine, prompt: str, seeds: list[int], params: dict, **extra) -> list[np.ndarray]:
    outs = engine.generate([prompt] * len(seeds),
                           [SamplingParams(seed=s, output_type="np", **params, **extra) for s in seeds])
    assert all(o.ok for o in outs)
    return [o.videos[0] for o in outs]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_PATH)
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--transition-chunks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="num_inference_steps (model default)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.chunks < 3 + args.transition_chunks:
        parser.error("--chunks must leave 2 chunks before and 1 after the transition")
    torch.set_num_threads(args.threads)
    clf, _ = build_judge()
    engine = DiffusionEngine(EngineConfig(model=str(args.model), max_batch_size=4 * args.seeds, num_threads=args.threads))
    spec = engine.spec
    params = {"num_inference_steps": args.steps} if args.steps else {}
    seeds = [args.seed + k for k in range(args.seeds)]
    start = time.perf_counter()

    # interaction check
    updated = run_streams(engine, seeds, params, args.chunks,
                          {"prompt": SECOND, "transition_chunks": args.transition_chunks})
    after = list(range(2 + args.transition_chunks, args.chunks))  # chunks that use SECOND alone
    read = {seed: [reads(clf, c) for c in r["chunks"]] for seed, r in updated.items()}
    first_use = {seed: [k for k, ids in enumerate(r["event_ids"]) if ids] for seed, r in updated.items()}
    assert all(v == [2] for v in first_use.values()), first_use  # the event id comes back on chunk 2
    passed = [seed for seed, r in read.items() if r[0] == 3 and r[1] == 3 and all(r[k] == 8 for k in after)]
    per_chunk = {k: {d: float(np.mean([read[s][k] == d for s in seeds])) for d in (3, 8)} for k in range(args.chunks)}
    ref3 = [reads(clf, v) == 3 for v in clips(engine, FIRST, seeds, params)]
    ref8 = [reads(clf, v) == 8 for v in clips(engine, SECOND, seeds, params)]

    # seam continuity
    f = spec.default_num_frames
    streamed = run_streams(engine, seeds, params, args.chunks, None)
    seams = [f + (f - 1) * k for k in range(args.chunks - 1)]
    stream_videos = [r["video"] for r in streamed.values()]
    independent = []
    per_chunk_clips = [clips(engine, FIRST, [args.seed + 1000 * (j + 1) + k for k in range(args.seeds)], params)
                       for j in range(args.chunks)]
    for k in range(args.seeds):
        independent.append(np.concatenate([per_chunk_clips[0][k]] + [per_chunk_clips[j][k][1:]
                                                                      for j in range(1, args.chunks)]))
    total = f + (f - 1) * (args.chunks - 1)
    long = clips(engine, FIRST, seeds, params, num_frames=total)
    continuity = {"stream": seam_stats(stream_videos, seams), "independent_chunks": seam_stats(independent, seams),
                  "single_long_generation": seam_stats(long, seams)}
    seconds = time.perf_counter() - start

    result = {
        "seeds": args.seeds, "chunks": args.chunks, "transition_chunks": args.transition_chunks,
        "num_frames_per_chunk": f, "steps": params.get("num_inference_steps", spec.default_num_inference_steps),
        "threads": args.threads,
        "interaction_pass_rate": len(passed) / len(seeds),
        "chunk_reads": {str(k): v for k, v in per_chunk.items()},
        "reference_clip_reads_3": float(np.mean(ref3)), "reference_clip_reads_8": float(np.mean(ref8)),
        "continuity": continuity, "seconds": seconds,
    }
    print(f"model: {args.model}  seeds: {args.seeds}  chunks: {args.chunks} x {f} frames  "
          f"steps: {result['steps']}  threads: {args.threads}")
    print(f"interaction '3' -> '8' (transition {args.transition_chunks}): event id on chunk 2 for every seed; "
          f"pass (chunks 0-1 read 3, chunks {after} read 8): {100 * result['interaction_pass_rate']:.0f} % "
          f"({len(passed)}/{len(seeds)})")
    for k in range(args.chunks):
        print(f"  chunk {k}: reads 3 {100 * per_chunk[k][3]:.0f} %, reads 8 {100 * per_chunk[k][8]:.0f} %")
    print(f"reference ordinary clips (same seeds): '3' read as 3 {100 * np.mean(ref3):.0f} %, "
          f"'8' read as 8 {100 * np.mean(ref8):.0f} %")
    print("seam continuity (digit column; px/frame):          |dx| seam  |dx| within   dx seam  dx within  "
          "|pixel change| seam / within")
    for name, c in continuity.items():
        print(f"  {name:26s} {c['seam_abs_dx']:20.2f} {c['within_abs_dx']:12.2f} {c['seam_dx']:9.2f} "
              f"{c['within_dx']:10.2f}   {c['seam_pixel']:.3f} / {c['within_pixel']:.3f}")
    print(f"wall clock: {seconds:.1f} s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
