"""How much a video VAE decode stalls the other requests' denoising steps.

A long request L keeps stepping while short video requests (same size, so they share L's
forwards) finish and are decoded. The engine runs decodes beside the steps on a side thread
(`diffserve.executor.inprocess`); the baseline runs them inline on the stepping thread
(``overlap_stages=False``). For each arm we time L's step intervals (from one step's end to the
next one's: everything that delays L's progress) and classify them as *during a decode* (more
than half of the interval overlaps a VAE decode) or *without* (no overlap), and print

    inflation = median(L's step interval during decodes) / median(L's step interval without)

and the stall, the progress L lost to decodes in seconds,

    stall = sum over intervals during decodes of (interval - median interval without),

per run, then the median and spread over ``--runs`` interleaved runs. Inline, the one interval
that holds the decode is the decode's whole length; beside the steps, it is the contention of
two threads (cores, memory bandwidth, the GIL; on GPU the shared stream).

The model: ``--model DIR`` (any ``WanPipeline`` folder; ``--load-format dummy`` for a weightless
config folder such as ``benchmarks/wan_config_folder.py``'s), or by default a probe folder built
here with random weights: Wan 2.1's VAE architecture (``AutoencoderKLWan`` defaults,
``--vae-base-dim`` 96 as in Wan 2.1; smaller = faster), a small Wan DiT and a small UMT5 (the
real 1.3B DiT and 5.7B UMT5-XXL do not fit a small CPU box).

Usage:
    python benchmarks/video_decode_stall.py --runs 3 --threads 1
    python benchmarks/video_decode_stall.py --model DIR --load-format dummy --device cuda --height 480 \\
        --width 832 --num-frames 81
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams


def build_probe_folder(out: Path, vae_base_dim: int) -> Path:
    """A random-weight ``WanPipeline`` folder: Wan 2.1's VAE architecture (base_dim
    `vae_base_dim`), a 4-block 512-wide Wan DiT, a 2-layer 256-wide UMT5, the Wan 2.1 scheduler."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from config_folder_tokenizers import t5_tokenizer
    from wan_config_folder import SCHEDULER

    torch.manual_seed(0)
    tokenizer = t5_tokenizer(pieces=0, extra_ids=0)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=256, d_ff=512, d_kv=32,
                                               num_layers=2, num_heads=8, pad_token_id=0, eos_token_id=1,
                                               decoder_start_token_id=0))
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=64,
                                        in_channels=16, out_channels=16, text_dim=256, freq_dim=256, ffn_dim=1024,
                                        num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=1024)
    vae = AutoencoderKLWan(base_dim=vae_base_dim)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=UniPCMultistepScheduler(**SCHEDULER), transformer=transformer)
    pipe.save_pretrained(out)
    return out


def run_once(engine: DiffusionEngine, steps: list, args, seed: int) -> dict:
    """One run: L plus ``--short-requests`` short ones; returns L's classified step intervals
    (seconds) and the decode intervals. `steps` receives (end time, requests) of every denoising
    step from the engine's step listener (every step holds L: it is the oldest request)."""
    runner = engine.runner
    decodes: list[tuple[float, float]] = []
    plain_decode = runner.decode

    def timed_decode(request_ids, preview=False, snapshots=None):
        start = time.perf_counter()
        try:
            return plain_decode(request_ids, preview, snapshots)
        finally:
            decodes.append((start, time.perf_counter()))

    steps.clear()
    runner.decode = timed_decode
    try:
        size = dict(height=args.height, width=args.width, num_frames=args.num_frames, output_type="np",
                    guidance_scale=args.guidance, max_sequence_length=args.max_sequence_length)
        long_id = engine.add_request("a long walk on the beach", SamplingParams(
            seed=seed, num_inference_steps=args.long_steps, **size))
        shorts = {engine.add_request(f"a short clip {i}", SamplingParams(seed=seed + 1 + i,
                                                                          num_inference_steps=args.short_steps, **size))
                  for i in range(args.short_requests)}
        baseline_from = None
        while engine.has_unfinished_requests():
            for event in engine.step():
                if event.type.is_final and event.request_id in shorts:
                    assert event.output.ok, event.output.error
                    shorts.discard(event.request_id)
            if baseline_from is None and not shorts:
                baseline_from = len(steps)
            if baseline_from is not None and len(steps) >= baseline_from + args.baseline_steps:
                engine.abort(long_id)
    finally:
        runner.decode = plain_decode
    if baseline_from is None or len(steps) < baseline_from + args.baseline_steps:
        raise SystemExit(f"L finished before the short requests' decodes and {args.baseline_steps} more steps: "
                         "raise --long-steps")
    during, without = [], []
    for (prev, _), (end, requests) in zip(steps, steps[1:]):
        if requests != 1:  # L shared this forward with short requests
            continue
        overlap = sum(max(0.0, min(end, d_end) - max(prev, d_start)) for d_start, d_end in decodes)
        if overlap > 0.5 * (end - prev):
            during.append(end - prev)
        elif overlap == 0:
            without.append(end - prev)
    base = statistics.median(without)
    return {"during": during, "without": without, "decode_s": sum(e - s for s, e in decodes),
            "inflation": statistics.median(during) / base if during else float("nan"),
            "stall_s": sum(d - base for d in during)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a WanPipeline folder (default: build the probe folder)")
    ap.add_argument("--load-format", default="default", choices=["default", "dummy"])
    ap.add_argument("--vae-base-dim", type=int, default=96, help="probe folder's VAE width (Wan 2.1: 96)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine thread")
    ap.add_argument("--height", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--num-frames", type=int, default=9)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--max-sequence-length", type=int, default=64)
    ap.add_argument("--long-steps", type=int, default=1000)
    ap.add_argument("--short-steps", type=int, default=2)
    ap.add_argument("--short-requests", type=int, default=2)
    ap.add_argument("--baseline-steps", type=int, default=10, help="L's steps timed after the decodes")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_probe_folder(Path(tmp) / "wan-probe", args.vae_base_dim)
        base = dict(model=str(model), load_format=args.load_format, device=args.device, dtype=args.dtype,
                    num_threads=args.threads, max_batch_size=2 * (1 + args.short_requests), prompt_embed_cache_size=0,
                    max_num_inference_steps=max(200, args.long_steps))
        side = DiffusionEngine(EngineConfig(**base, overlap_stages=True))
        inline = DiffusionEngine(EngineConfig(**base, overlap_stages=False), runner=side.runner)
        steps: list[tuple[float, int]] = []
        for engine in (side, inline):
            engine.add_step_listener(lambda rows, requests, seconds: steps.append((time.perf_counter(), requests)))
        print(f"model {'probe (vae base_dim %d)' % args.vae_base_dim if args.model is None else model}, "
              f"{args.width}x{args.height}, {args.num_frames} frames, device {args.device}, "
              f"{torch.get_num_threads()} torch thread(s) per engine thread, {args.short_requests} short "
              f"requests x {args.short_steps} steps decoded while L steps; load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs")
        results: dict[str, list[dict]] = {"beside the steps (side thread)": [], "inline (baseline)": []}
        for run in range(args.runs):
            for (name, engine) in zip(results, (side, inline)):  # interleaved arms
                r = run_once(engine, steps, args, seed=100 * run)
                results[name].append(r)
                print(f"  run {run} {name}: decode {r['decode_s']:.2f} s, L's step interval "
                      f"{statistics.median(r['without']) * 1e3:.1f} ms without / "
                      f"{statistics.median(r['during']) * 1e3 if r['during'] else float('nan'):.1f} ms during "
                      f"({len(r['during'])} intervals) -> inflation {r['inflation']:.2f}x, stall {r['stall_s']:.2f} s")
        print("summary (median over runs [min, max]):")
        for name, runs in results.items():
            parts = []
            for key, label, unit in (("inflation", "step-interval inflation during decodes", "x"),
                                     ("stall_s", "stall", " s"), ("decode_s", "decode", " s")):
                values = [r[key] for r in runs]
                parts.append(f"{label} {statistics.median(values):.2f}{unit} [{min(values):.2f}, {max(values):.2f}]")
            print(f"  {name}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
