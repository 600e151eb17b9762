"""Where a denoising step's time goes, layer by layer: the engine (`DiffusionEngine.step`:
request scheduler, plan, events), the model runner (`ModelRunner.step`: inference mode, offload
stage, memory window), the adapter's step (`collate` + `denoise` + `combine` + diffusion-scheduler
`step`) and the denoiser forward alone (`PipelineAdapter.denoise`).

Each layer's time includes the layers below it; the differences are each layer's own work.
Reports the median and the mean per step (the mean shows rare slow calls, e.g. a lock wait)
over `--steps` steps of `--requests` requests batched together (after 20 warm-up steps), and
the RSS high-water-mark resets the CPU memory windows made (`diffserve.memory.accounting`).

Usage::

    python benchmarks/step_overhead.py                      # built-in model, 1 request, 200 steps
    python benchmarks/step_overhead.py --requests 16 --repeats 3
    python benchmarks/step_overhead.py --reset-every-step   # the memory window's old cost
    python benchmarks/step_overhead.py --requests 16 --churn --repeats 3   # a new composition every step
    python benchmarks/step_overhead.py --requests 32 --null-forward        # the layers' work alone

With ``--churn`` one request joins and one leaves at every step (each runs ``--requests``
steps, so that many are in flight): every step's batch is a new composition, as under
open-loop traffic, and the adapter rebuilds its batch tables each step. The joining request's
prepare and the leaving one's decode run inside the engine's step there; they are timed and
left out of the engine's own time (and reported on their own).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import diffserve.memory.accounting as runner_memory
from diffserve import DiffusionEngine, EngineConfig, SamplingParams

LAYERS = ("engine", "runner", "adapter step", "denoiser forward")


def _timed(owner, name: str, into: list[float]) -> None:
    """Replace ``owner.name`` by a wrapper appending each call's seconds to `into`."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def main() -> None:
    """Parse the options, step the requests with every layer timed, print the table (microseconds)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or built-in name (default: the built-in model)")
    ap.add_argument("--requests", type=int, default=1, help="requests stepped together")
    ap.add_argument("--steps", type=int, default=200, help="num_inference_steps of each request (<= 200)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="runs; medians/means are over all of them")
    ap.add_argument("--churn", action="store_true",
                    help="one request joins and one leaves at every step (see above)")
    ap.add_argument("--no-progress", action="store_true",
                    help="the requests ask for no per-step progress events (as `generate` without on_event and "
                         "the server's non-streaming requests): the engine's work per step no longer grows with them")
    ap.add_argument("--null-forward", action="store_true",
                    help="replace the denoiser forward by zeros of its output's shape: the layers' own work "
                         "without the forward evicting the CPU caches first (what a GPU's host does while an "
                         "asynchronous forward runs)")
    ap.add_argument("--reset-every-step", action="store_true",
                    help="CPU: reset the RSS high-water mark at every step's memory window (what diffserve did "
                         "before resets were spaced by STEP_RESET_INTERVAL_S), to compare")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = DiffusionEngine(EngineConfig(model=args.model, num_threads=args.threads, overlap_stages=False,
                                          max_batch_size=max(64, 2 * args.requests)))
    runner, adapter = engine.runner, engine.runner.adapter
    if args.null_forward:
        adapter.denoise = lambda batch, call=None: torch.zeros(batch.num_rows, *batch.latents.shape[1:],
                                                               dtype=batch.latents.dtype, device=batch.latents.device)
    if args.reset_every_step:
        runner.memory.window = lambda batch=None: runner_memory.PeakWindow(runner.memory.device)
    times: dict[str, list[float]] = defaultdict(list)
    _timed(runner, "step", times["runner"])
    _timed(runner, "_step", times["adapter step"])
    _timed(adapter, "denoise", times["denoiser forward"])
    _timed(runner_memory, "_reset_hwm", times["hwm resets"])
    _timed(runner, "prepare", times["prepare"])
    _timed(runner, "decode", times["decode"])
    params = [SamplingParams(num_inference_steps=args.steps, seed=i, output_type="latent") for i in range(args.requests)]
    engine.generate(["digit 5"] * args.requests, [SamplingParams(num_inference_steps=5, seed=0, output_type="latent")
                                                  for _ in range(args.requests)])  # warm-up
    progress = {"progress": False} if args.no_progress else {}
    kept: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.repeats):
        for series in times.values():
            series.clear()
        if args.churn:
            engine_times = _run_churn(engine, args.requests, args.steps, times, progress)
            skip, end = args.requests + 20, -args.requests  # full batches only: no ramp-up/down
        else:
            for p in params:
                engine.add_request("digit 5", p, **progress)
            engine_times = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                engine_times.append(time.perf_counter() - start)
            skip, end = 20, None  # after warm-up steps
        times["engine"] = engine_times
        for layer in LAYERS:
            steps = times[layer] if layer != "engine" else [t for t in times[layer] if t > 0]
            kept[layer] += steps[skip:end]
        for side in ("prepare", "decode"):
            kept[side] += times[side]
        kept["hwm resets"] += times["hwm resets"]
    print(f"model={engine.config.model_path.name} requests={args.requests} steps={args.steps} "
          f"threads={args.threads} repeats={args.repeats}")
    print(f"{'layer':18s} {'median us':>10s} {'mean us':>10s} {'own median us':>14s}")
    medians = {layer: statistics.median(kept[layer]) for layer in LAYERS}
    for i, layer in enumerate(LAYERS):
        below = medians[LAYERS[i + 1]] if i + 1 < len(LAYERS) else 0.0
        print(f"{layer:18s} {medians[layer] * 1e6:10.0f} {statistics.mean(kept[layer]) * 1e6:10.0f} "
              f"{(medians[layer] - below) * 1e6:14.0f}")
    resets = kept["hwm resets"]
    if resets:
        print(f"RSS high-water-mark resets: {len(resets)} (median {statistics.median(resets) * 1e6:.0f} us, "
              f"mean {statistics.mean(resets) * 1e6:.0f} us)")
    if args.churn:
        for side in ("prepare", "decode"):
            print(f"{side} (left out of the engine's time): {statistics.median(kept[side]) * 1e6:.0f} us median "
                  f"per call, {len(kept[side])} calls")
    overhead = medians["engine"] - medians["adapter step"]
    print(f"engine + runner work per step beyond the adapter: {overhead * 1e6:.0f} us "
          f"({overhead / medians['adapter step']:+.1%} of the adapter step)")


def _run_churn(engine: DiffusionEngine, in_flight: int, total: int, times: dict[str, list[float]],
               progress: dict) -> list[float]:
    """Add one request (running `in_flight` steps; `progress`: add_request's progress option)
    before each of `total` engine steps, then drain; returns each engine step's seconds minus
    the prepare/decode time inside it."""
    engine_times, added = [], 0
    while added < total or engine.has_unfinished_requests():
        if added < total:
            engine.add_request("digit 5", SamplingParams(num_inference_steps=in_flight, seed=added,
                                                         output_type="latent"), **progress)
            added += 1
        side = sum(times["prepare"]) + sum(times["decode"])
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        engine_times.append(elapsed - (sum(times["prepare"]) + sum(times["decode"]) - side))
    return engine_times


if __name__ == "__main__":
    main()
