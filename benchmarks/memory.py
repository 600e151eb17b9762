"""Memory benchmark: peak device memory and throughput with and without each offload mode.

Arms (the same workload each): ``none`` (all weights on the device), ``model`` (model CPU
offload, `--cpu-offload`), ``layerwise`` (`--layerwise-offload --offload-blocks N`) and
``model+layerwise`` (both). Every trial of every arm runs in a fresh subprocess, so peaks do
not leak between arms; trials are interleaved (arm 1, arm 2, ..., arm 1, arm 2, ...) and the
medians with their spread (min, max) are reported, with ratios against ``none`` measured in
the same run.

Per arm and trial: the engine loads (the dummy weights of an offload arm are initialised on
the CPU, where they live), serves one warm-up request, then ``--requests`` concurrent requests.
Reported: ``resident_bytes`` (device memory after loading: CUDA allocator bytes in use; CPU:
process RSS), ``peak_bytes`` (the peak while serving: CUDA allocator peak; CPU: process RSS
high-water mark), ``request_peak_bytes`` (median per-request peak above the resident model, see
`diffserve.core.outputs.RequestMetrics`), ``images_per_s`` and ``offload_loads_per_request``.
On a CPU device the offload arms move nothing (the device is the CPU): the CPU run checks the
script, not the savings.

Sleep mode (in the ``none`` arm, after serving; the engine is built with ``enable_sleep_mode``):
for level 1 and level 2, the device memory a sleep frees (``freed_bytes``, vs the weights'
``weight_bytes``), the seconds to sleep and to wake, and whether a request run alone after
waking is byte-identical to the same request run alone before sleeping.

The last line printed is one JSON object with everything.

Usage:
    python benchmarks/memory.py                       # SD3-medium architecture (dummy weights),
                                                      # 1024x1024, 28 steps, guidance 7, GPU
    python benchmarks/memory.py --model DIR --size 64 --steps 4 --requests 4 --device cpu --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {
    "none": {},
    "model": {"cpu_offload": True},
    "layerwise": {"layerwise_offload": True},
    "model+layerwise": {"cpu_offload": True, "layerwise_offload": True},
}


def run_arm(args: argparse.Namespace) -> dict:
    """One trial of one arm in this process (the child side)."""
    import torch

    from diffserve import DiffusionEngine, EngineConfig, SamplingParams
    from diffserve.memory.accounting import PeakWindow, release_host_memory, rss_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    options = dict(ARMS[args.arm])
    if options.get("layerwise_offload"):
        options["offload_blocks"] = args.offload_blocks
    config = EngineConfig(model=args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                          max_batch_size=args.max_batch_size, num_threads=args.threads,
                          enable_sleep_mode=args.arm == "none", **options)
    device = config.torch_device

    def in_use() -> int:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return int(torch.cuda.memory_allocated(device))
        release_host_memory()
        return rss_bytes() or 0

    with PeakWindow(device) as load:
        engine = DiffusionEngine(config)
    resident = in_use()
    params = [SamplingParams(seed=i, num_inference_steps=args.steps, guidance_scale=args.guidance,
                             height=args.size, width=args.size, output_type="latent" if args.latent else "np")
              for i in range(args.requests)]
    [warm] = engine.generate("warm-up", SamplingParams(seed=99, num_inference_steps=2, guidance_scale=args.guidance,
                                                       height=args.size, width=args.size, output_type="np"))
    assert warm.ok, warm.error
    resident_after_warmup = in_use()
    prompts = [f"a photo of object number {i}" for i in range(args.requests)]
    with PeakWindow(device) as serve:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    request_peaks = [o.metrics.request_peak_memory_bytes for o in outs if o.metrics.request_peak_memory_bytes is not None]
    stats = engine.stats().get("offload", {})
    sleep = {}
    if args.arm == "none":
        [reference] = engine.generate(prompts[0], params[0])  # alone, as after waking
        for level in (1, 2):
            before = in_use()
            start = time.perf_counter()
            engine.sleep(level)
            sleep_s = time.perf_counter() - start
            freed = before - in_use()
            start = time.perf_counter()
            engine.wake_up()
            wake_s = time.perf_counter() - start
            [again] = engine.generate(prompts[0], params[0])
            first, second = reference.images, again.images
            same = bool((first == second).all()) if hasattr(first, "all") else False
            sleep[f"level{level}"] = {"freed_bytes": freed, "sleep_s": sleep_s, "wake_s": wake_s, "identical": same}
    return {
        "arm": args.arm,
        "load_peak_bytes": load.peak,
        "resident_bytes": resident,
        "resident_after_warmup_bytes": resident_after_warmup,
        "peak_bytes": serve.peak,
        "request_peak_bytes": statistics.median(request_peaks) if request_peaks else None,
        "images_per_s": len(outs) / seconds,
        "seconds": seconds,
        "offload_loads_per_request": statistics.median(o.metrics.offload_loads for o in outs),
        "offload_loads_total": stats.get("loads"),
        "weight_bytes": sum(engine.runner.memory.offload.bytes.values()),
        "device": str(device),
        "sleep": sleep,
    }


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="diffusers folder (default: SD3-medium's configs, written to a temp folder)")
    ap.add_argument("--load-format", default="dummy", choices=["default", "dummy"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--size", type=int, default=1024, help="height = width in pixels (default 1024)")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--guidance", type=float, default=7.0)
    ap.add_argument("--requests", type=int, default=4, help="concurrent requests per trial")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--offload-blocks", type=int, default=1)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (report it with CPU numbers)")
    ap.add_argument("--latent", action="store_true", help="skip the VAE decode (output_type=latent)")
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # child mode: run one trial
    args = ap.parse_args()
    if args.arm is not None:
        print(json.dumps(run_arm(args)))
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    tmp = None
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from sd3_config_folder import write_folder

        tmp = tempfile.TemporaryDirectory(prefix="sd3m-")
        args.model = str(write_folder(Path(tmp.name) / "sd3-medium-arch"))
    child = [sys.executable, __file__, "--model", args.model, "--load-format", args.load_format,
             "--device", args.device, "--dtype", args.dtype, "--size", str(args.size), "--steps", str(args.steps),
             "--guidance", str(args.guidance), "--requests", str(args.requests),
             "--max-batch-size", str(args.max_batch_size), "--offload-blocks", str(args.offload_blocks)]
    if args.threads:
        child += ["--threads", str(args.threads)]
    if args.latent:
        child += ["--latent"]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for trial in range(args.trials):
        for arm in arms:
            proc = subprocess.run(child + ["--arm", arm], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"arm {arm} trial {trial} failed (exit {proc.returncode})")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            results[arm].append(result)
            print(f"trial {trial} {arm:16s} peak {result['peak_bytes'] / 2**30:7.2f} GiB  resident "
                  f"{result['resident_bytes'] / 2**30:7.2f} GiB  {result['images_per_s']:.3f} img/s  "
                  f"loads/request {result['offload_loads_per_request']}", flush=True)
    summary = {}
    for arm, runs in results.items():
        summary[arm] = {key: _spread([r[key] for r in runs]) for key in
                        ("peak_bytes", "resident_bytes", "load_peak_bytes", "images_per_s")}
        request_peaks = [r["request_peak_bytes"] for r in runs if r["request_peak_bytes"] is not None]
        summary[arm]["request_peak_bytes"] = _spread(request_peaks) if request_peaks else None
        summary[arm]["offload_loads_per_request"] = statistics.median(r["offload_loads_per_request"] for r in runs)
        summary[arm]["weight_bytes"] = runs[0]["weight_bytes"]
        summary[arm]["resident_after_warmup_bytes"] = _spread([r["resident_after_warmup_bytes"] for r in runs])
        if runs[0]["sleep"]:
            summary[arm]["sleep"] = {level: {
                "freed_bytes": _spread([r["sleep"][level]["freed_bytes"] for r in runs]),
                "sleep_s": _spread([r["sleep"][level]["sleep_s"] for r in runs]),
                "wake_s": _spread([r["sleep"][level]["wake_s"] for r in runs]),
                "identical": all(r["sleep"][level]["identical"] for r in runs)} for level in runs[0]["sleep"]}
    if "none" in summary:
        base = summary["none"]
        for arm, s in summary.items():
            s["peak_vs_none"] = s["peak_bytes"]["median"] / base["peak_bytes"]["median"]
            s["throughput_vs_none"] = s["images_per_s"]["median"] / base["images_per_s"]["median"]
    first = next(iter(results.values()))[0]
    print(json.dumps({
        "benchmark": "memory", "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": Path(args.model).name, "load_format": args.load_format, "device": first["device"],
        "size": args.size, "steps": args.steps, "guidance": args.guidance, "requests": args.requests,
        "offload_blocks": args.offload_blocks, "threads": args.threads, "trials": args.trials, "arms": summary,
    }))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
