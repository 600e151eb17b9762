"""CLI start-up: cold ``diffserve generate`` (one image, built-in model) vs ``import torch``.

Every measurement is a fresh Python process (wall clock, seconds), run interleaved so machine
load hits every arm alike; the median of ``--trials`` runs (>= 3) and the spread (min-max) are
printed, then the ratio cold generate / ``python -c "import torch"`` (target: <= 2x).

Arms:
    import torch            ``python -c "import torch"``: the baseline no torch program beats
    generate                ``python -m diffserve generate "a handwritten digit 7" --threads 1``
                            (the README's main job, one image, into a temporary folder)
    --help, bad flag        ``diffserve generate --help`` and ``--steps 0``: answered before any
                            heavy import
With ``--breakdown`` also:
    import model classes    torch plus only the diffusers/transformers classes the built-in model
                            is made of (SD3 transformer, VAE, flow-matching scheduler, CLIP text
                            encoders and tokenizers): the floor of importing through those
                            libraries (their packages import eagerly: every diffusers transformer
                            model, torch._dynamo, scipy.stats/optimize)
    import diffusers.utils  torch plus ``diffusers.utils``, which every diffusers import runs first
                            (it imports torch._dynamo, sympy, torch.fx)
    import engine           ``import diffserve.engine.engine`` (what ``generate`` imports)

Usage: python benchmarks/startup.py [--trials 5] [--breakdown]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

MODEL_CLASSES = (
    "import torch; "
    "import diffusers.models.transformers.transformer_sd3, diffusers.models.autoencoders.autoencoder_kl, "
    "diffusers.schedulers.scheduling_flow_match_euler_discrete; "
    "import transformers.models.clip.modeling_clip, transformers.models.clip.tokenization_clip"
)


def arms(out_dir: str, breakdown: bool) -> dict[str, list[str]]:
    py = sys.executable
    result = {
        "import torch": [py, "-c", "import torch"],
        "generate": [py, "-m", "diffserve", "generate", "a handwritten digit 7", "--threads", "1", "--seed", "0",
                     "-o", out_dir],
        "--help": [py, "-m", "diffserve", "generate", "--help"],
        "bad flag": [py, "-m", "diffserve", "generate", "a digit", "--steps", "0", "-o", out_dir],
    }
    if breakdown:
        result["import diffusers.utils"] = [py, "-c", "import torch, diffusers.utils"]
        result["import model classes"] = [py, "-c", MODEL_CLASSES]
        result["import engine"] = [py, "-c", "import diffserve.engine.engine"]
    return result


def run_once(cmd: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    expected = 2 if "--steps" in cmd else 0
    if proc.returncode != expected:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="runs per arm, interleaved (>= 3)")
    parser.add_argument("--breakdown", action="store_true", help="also time the import floor and the engine import")
    args = parser.parse_args()
    if args.trials < 3:
        parser.error("--trials must be >= 3")
    with tempfile.TemporaryDirectory() as out_dir:
        commands = arms(out_dir, args.breakdown)
        run_once(commands["import torch"])  # warm the page cache and .pyc files before timing
        run_once(commands["generate"])
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.trials):
            for name, cmd in commands.items():
                times[name].append(run_once(cmd))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.trials} interleaved trials; "
          "wall seconds per fresh process")
    print(f"{'arm':24} {'median':>8} {'min':>8} {'max':>8}")
    for name, values in times.items():
        print(f"{name:24} {statistics.median(values):8.2f} {min(values):8.2f} {max(values):8.2f}")
    ratio = statistics.median(times["generate"]) / statistics.median(times["import torch"])
    per_trial = [g / t for g, t in zip(times["generate"], times["import torch"])]
    print(f"cold generate / import torch: {ratio:.2f}x (per trial {min(per_trial):.2f}-{max(per_trial):.2f}x; "
          "target <= 2x)")


if __name__ == "__main__":
    main()
