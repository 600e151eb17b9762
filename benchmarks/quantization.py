"""Quantization benchmark: step-mode throughput and memory of each method against the model
dtype, on a model of a realistic size.

Arms (the same workload each): ``fp32`` (no quantization; the model dtype), ``int8_weight_only``
and ``int8_dynamic`` (CPU and GPU), ``float8`` and ``int4_weight_only`` (GPU only; pass them in
``--arms``). Every trial of every arm runs in a fresh subprocess, so memory peaks do not leak
between arms; trials are interleaved (arm 1, arm 2, ..., arm 1, arm 2, ...) and rotated (each
trial starts one arm later) so drift on a shared machine spreads over the arms; the median and
spread (min, max) of each measure are reported, with the ratio of the medians against the
first arm measured in the same run.

Per arm and trial, the engine loads (``--load-format dummy``: seeded random weights; with a
method, quantized at load), serves one warm-up request, then ``--requests`` concurrent
requests in step mode. Reported:

- ``images_per_s`` (wall clock of the concurrent requests) and ``steps_per_s`` (denoising
  steps of all requests per second of that wall clock);
- ``weight_bytes``: the engine's own accounting of the weights (``stats()["offload"]
  ["resident_weight_bytes"]``; tensor subclasses counted by their real storage) and, per
  quantized component, its bytes and ratio to the same weights unquantized
  (``stats()["quantization"]``);
- ``resident_bytes`` (after load: CUDA allocator bytes in use; CPU: process RSS after
  ``malloc_trim``), ``peak_bytes`` (while serving: CUDA allocator peak; CPU: RSS high-water
  mark), ``load_peak_bytes`` (while loading and quantizing: the unquantized weights are
  loaded first).

Default model: SD3-medium's architecture (`sd3_config_folder.py`: the transformer at its
real width, 1536, with ``--num-layers`` of its 24 blocks; CLIP-L and CLIP-G at full size; T5
left out), dummy weights, so one thread finishes in minutes. ``--arch sdxl`` uses SDXL's UNet
(`sdxl_config_folder.py`, full size).

``--psnr-families`` instead measures quality per family: every tiny folder of the test registry
(``tests/tiny_models/registry.py``: SD3, Flux, Flux Kontext, SD 1.5, SDXL, Qwen-Image,
Qwen-Image-Edit, Wan 2.1 / 2.2; random weights, so images are noise-like, but every layer runs)
serves the same requests (``--psnr-requests`` seeds, ``--steps`` steps, the registry's sizes,
guidance on) unquantized and with each method, and the PSNR (dB, uint8 pixels) of each method's
images against the unquantized ones is reported per family, with the automatic skip list's
choice (``--psnr-budget``) as one more arm (``<method>+auto``).

Usage:
    python benchmarks/quantization.py --psnr-families --threads 1 --steps 4
    python benchmarks/quantization.py --threads 1                       # CPU: fp32 vs int8 arms
    python benchmarks/quantization.py --threads 1 --compile             # the same, regional compile
    python benchmarks/quantization.py --device cuda --dtype bf16 --num-layers 24 --size 1024 \\
        --steps 28 --arms bf16,float8,int4_weight_only                  # GPU

The last line printed is one JSON object with everything.
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

#: Arm names that mean "no quantization" (the baseline in the model dtype).
BASELINES = ("fp32", "bf16", "fp16", "none")


def run_arm(args: argparse.Namespace) -> dict:
    """One trial of one arm in this process (the child side)."""
    import torch

    from diffserve import DiffusionEngine, EngineConfig, SamplingParams
    from diffserve.memory.accounting import PeakWindow, release_host_memory, rss_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    method = None if args.arm in BASELINES else args.arm
    config = EngineConfig(model=args.model, load_format="dummy", device=args.device, dtype=args.dtype,
                          max_batch_size=args.max_batch_size, num_threads=args.threads, quantization=method,
                          compile=args.compile)
    device = config.torch_device

    def in_use() -> int:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            return int(torch.cuda.memory_allocated(device))
        release_host_memory()
        return rss_bytes() or 0

    start = time.perf_counter()
    with PeakWindow(device) as load:
        engine = DiffusionEngine(config)
    load_s = time.perf_counter() - start
    resident = in_use()
    output_type = "latent" if args.latent else "np"
    [warm] = engine.generate("warm-up", SamplingParams(seed=99, num_inference_steps=2, guidance_scale=args.guidance,
                                                       height=args.size, width=args.size, output_type=output_type))
    assert warm.ok, warm.error
    prompts = [f"a photo of object number {i}" for i in range(args.requests)]
    params = [SamplingParams(seed=i, num_inference_steps=args.steps, guidance_scale=args.guidance,
                             height=args.size, width=args.size, output_type=output_type)
              for i in range(args.requests)]
    with PeakWindow(device) as serve:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    stats = engine.stats()
    quantization = stats.get("quantization") or {}
    return {
        "arm": args.arm,
        "load_s": load_s,
        "load_peak_bytes": load.peak,
        "resident_bytes": resident,
        "peak_bytes": serve.peak,
        "images_per_s": len(outs) / seconds,
        "steps_per_s": len(outs) * args.steps / seconds,
        "seconds": seconds,
        "weight_bytes": stats["offload"]["resident_weight_bytes"],
        "components": {name: {k: r[k] for k in ("method", "bytes", "full_precision_bytes", "ratio")}
                       for name, r in (quantization.get("components") or {}).items()},
        "recompiles_after_warmup": stats.get("acceleration", stats).get("compile", {}).get("recompiles_after_warmup"),
        "device": str(device),
    }


def write_model(args: argparse.Namespace, root: Path) -> Path:
    """The benchmark folder: SD3-medium's (``--num-layers`` of its 24 blocks) or SDXL's
    architecture, configs only."""
    sys.path.insert(0, str(Path(__file__).parent))
    if args.arch == "sdxl":
        from sdxl_config_folder import write_folder

        return write_folder(root / "sdxl-arch")
    from sd3_config_folder import write_folder

    folder = write_folder(root / "sd3-medium-arch")
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["num_layers"] = args.num_layers
    config_path.write_text(json.dumps(config, indent=2))
    return folder


def psnr_families(args: argparse.Namespace) -> dict:
    """Per family of the test registry: PSNR of each arm's images against the unquantized
    engine's (see the module docstring)."""
    import numpy as np
    import torch
    from PIL import Image

    from diffserve import DiffusionEngine, EngineConfig
    from diffserve.core.inputs import make_inputs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models.registry import MODELS

    torch.set_num_threads(args.threads or 1)
    arms = [a.strip() for a in args.arms.split(",") if a.strip() and a.strip() not in BASELINES]
    arms += [f"{a}+auto" for a in arms]
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="quant-psnr-") as tmp:
        for model in MODELS:
            if model.build is None:
                continue
            folder = model.folder(Path(tmp) / model.id)
            inputs = None
            if model.images == "required":
                inputs = make_inputs(Image.new("RGB", model.input_size, (120, 80, 200)))
            params = [model.params(seed=i, num_inference_steps=args.steps, **model.guided)
                      for i in range(args.psnr_requests)]
            prompts = [f"a photo of object number {i}" for i in range(args.psnr_requests)]

            def images(**options) -> list:
                engine = DiffusionEngine(EngineConfig(model=str(folder), num_threads=args.threads, **options))
                outs = engine.generate(prompts, params, inputs=[inputs] * len(prompts) if inputs else None)
                assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
                stats = engine.stats()["quantization"]
                engine.shutdown()
                return [np.asarray(o.videos[0] if o.videos else o.images, np.float64) for o in outs], stats

            with model.patch():
                reference, _ = images()
                row = {}
                for arm in arms:
                    method, _, skip = arm.partition("+")
                    budget = {"quantization_error_budget": args.psnr_budget} if skip else {}
                    got, stats = images(quantization=method, quantization_skip=skip or None, **budget)
                    mse = np.mean([np.mean((_uint8(a) - _uint8(b)) ** 2) for a, b in zip(got, reference)])
                    kept = sum(len(c["kept_layers"]) for c in stats["components"].values()
                               if c["source"] == "quantized at load")
                    row[arm] = {"psnr_db": float("inf") if mse == 0 else 10 * float(np.log10(255.0 ** 2 / mse)),
                                "kept_layers": kept}
            out[model.id] = row
            print(f"{model.id:34s} " + "  ".join(f"{arm} {r['psnr_db']:6.2f} dB (kept {r['kept_layers']})"
                                                  for arm, r in row.items()), flush=True)
    return out


def _uint8(images):
    """Images in [0, 1] (or uint8) as float uint8 levels."""
    import numpy as np

    images = np.asarray(images, np.float64)
    return images if images.max() > 1.5 else np.round(np.clip(images, 0, 1) * 255)


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a diffusers folder (default: --arch's configs, in a temp folder)")
    ap.add_argument("--arch", default="sd3", choices=["sd3", "sdxl"])
    ap.add_argument("--num-layers", type=int, default=4, help="SD3-medium transformer blocks (real model: 24)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--size", type=int, default=512, help="height = width in pixels")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guidance", type=float, default=7.0)
    ap.add_argument("--requests", type=int, default=2, help="concurrent requests per trial")
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--arms", default="fp32,int8_weight_only,int8_dynamic",
                    help="comma-separated: a baseline (fp32 / bf16 / fp16: no quantization) first, then methods")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (report it with CPU numbers)")
    ap.add_argument("--compile", action="store_true", help="regional torch.compile in every arm")
    ap.add_argument("--latent", action="store_true", help="skip the VAE decode (output_type=latent)")
    ap.add_argument("--psnr-families", action="store_true",
                    help="quality instead of speed: PSNR vs unquantized per family on the tiny test folders")
    ap.add_argument("--psnr-requests", type=int, default=2, help="requests per family with --psnr-families")
    ap.add_argument("--psnr-budget", type=float, default=0.03,
                    help="quantization_error_budget of the +auto arms with --psnr-families")
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # child mode: run one trial
    args = ap.parse_args()
    if args.arm is not None:
        print(json.dumps(run_arm(args)))
        return
    if args.psnr_families:
        result = psnr_families(args)
        print(json.dumps({"benchmark": "quantization-psnr", "command": " ".join([Path(sys.executable).name,
                                                                                 *sys.argv]),
                          "steps": args.steps, "requests": args.psnr_requests, "threads": args.threads,
                          "auto_budget": args.psnr_budget,
                          "families": result}))
        return
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="quant-bench-")
        args.model = str(write_model(args, Path(tmp.name)))
    child = [sys.executable, __file__, "--model", args.model, "--device", args.device, "--dtype", args.dtype,
             "--size", str(args.size), "--steps", str(args.steps), "--guidance", str(args.guidance),
             "--requests", str(args.requests), "--max-batch-size", str(args.max_batch_size)]
    if args.threads:
        child += ["--threads", str(args.threads)]
    child += ["--compile"] * args.compile + ["--latent"] * args.latent
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for trial in range(args.trials):
        for arm in arms[trial % len(arms):] + arms[:trial % len(arms)]:
            proc = subprocess.run(child + ["--arm", arm], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"arm {arm} trial {trial} failed (exit {proc.returncode})")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            results[arm].append(result)
            print(f"trial {trial} {arm:18s} {result['steps_per_s']:.3f} steps/s  {result['images_per_s']:.4f} img/s  "
                  f"weights {result['weight_bytes'] / 2**30:6.2f} GiB  resident {result['resident_bytes'] / 2**30:6.2f} "
                  f"GiB  serving peak {result['peak_bytes'] / 2**30:6.2f} GiB  load {result['load_s']:.0f} s",
                  flush=True)
    summary = {}
    for arm, runs in results.items():
        summary[arm] = {key: _spread([r[key] for r in runs]) for key in
                        ("steps_per_s", "images_per_s", "peak_bytes", "resident_bytes", "load_peak_bytes", "load_s")}
        summary[arm]["weight_bytes"] = runs[0]["weight_bytes"]
        summary[arm]["components"] = runs[0]["components"]
        summary[arm]["recompiles_after_warmup"] = [r["recompiles_after_warmup"] for r in runs]
    base = summary[arms[0]]
    for arm, s in summary.items():
        s["throughput_vs_baseline"] = s["steps_per_s"]["median"] / base["steps_per_s"]["median"]
        s["weight_bytes_vs_baseline"] = s["weight_bytes"] / base["weight_bytes"]
        s["peak_vs_baseline"] = s["peak_bytes"]["median"] / base["peak_bytes"]["median"]
        s["resident_vs_baseline"] = s["resident_bytes"]["median"] / base["resident_bytes"]["median"]
    for arm, s in summary.items():
        print(f"{arm:18s} throughput x{s['throughput_vs_baseline']:.2f} ({s['steps_per_s']['median']:.3f} steps/s, "
              f"{s['steps_per_s']['min']:.3f}-{s['steps_per_s']['max']:.3f})  weights x{s['weight_bytes_vs_baseline']:.2f}"
              f"  resident x{s['resident_vs_baseline']:.2f}  serving peak x{s['peak_vs_baseline']:.2f}  "
              + "  ".join(f"{c} {v['ratio']:.3f}" for c, v in s["components"].items() if v.get("ratio")))
    first = next(iter(results.values()))[0]
    print(json.dumps({
        "benchmark": "quantization", "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": Path(args.model).name, "arch": args.arch, "num_layers": args.num_layers, "device": first["device"],
        "size": args.size, "steps": args.steps, "guidance": args.guidance, "requests": args.requests,
        "threads": args.threads, "compile": args.compile, "trials": args.trials, "arms": summary,
    }))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
