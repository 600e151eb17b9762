"""Serving benchmark: diffusers one at a time and with static batches vs diffserve `request` and
`step` modes.

One process, the same workload for every arm, arms interleaved (`--repeats R` runs them R times
and reports medians with ranges; `--json` ends with a machine-readable line):
  (a) baseline: diffusers' own pipeline (the class named in model_index.json) serving requests
      one at a time in arrival order (built on the very same loaded components);
  (b) diffusers with static batches: whenever idle, one pipeline call on every request that
      has arrived (up to the concurrency), a list of prompts with one generator each;
  (c) diffserve `request` mode: static batches run to completion;
  (d) diffserve `step` mode: continuous batching, one denoising step at a time;
  optional arms: step mode with encode/decode inline instead of on the executor's side thread
  (`step_inline`), with each prompt encoded alone instead of the texts of requests admitted
  together in one encoder forward (`step_encode_alone`), and on 2 worker processes,
  CFG-parallel (`step_cfg2`) or Ulysses (`step_ulysses2`), e.g.
  `--arms step,step_inline,step_cfg2,step_ulysses2 --repeats 3`.

Load: `--concurrency N` keeps N requests outstanding (closed loop), or `--request-rate R`
sends Poisson arrivals at R requests/s (open loop; `--request-rate auto` = 80% of the step
mode's capacity measured at `--concurrency`). Prompts are mixed; `--mixed-steps` and
`--mixed-sizes` mix step counts and resolutions.

It also prints the ceiling (the bare transformer forward at the batch size step mode reached,
vs batch 1) and the engine overhead at batch 1 (diffserve's time per step vs the bare adapter
forward + diffusion-scheduler step on the same inputs). Both are measured inside every repeat.
The ceiling is a throughput like the arms': as many back-to-back forwards as the step arm
has steps, right before and right after it (their mean, so a machine speeding up or slowing
down during the arm favours neither), total time / count; each repeat's step throughput is
compared with its own ceiling (on a shared machine a ceiling measured once, apart from the
arms, once read "112 % of the ceiling"). The overhead is the median of back-to-back pairs
(one diffserve request, one bare loop, order alternating); the same pairs also give it between
forwards: each side's median gap from the end of one denoiser forward to the start of the next
(everything a step does besides its forward), the difference divided by a bare step, which
leaves the forwards' own run-to-run noise out (on CUDA the forwards are timed on the host, without
a synchronisation that would change what is measured: there the gaps and the in-situ ratio below
measure host work; the ceiling's forwards are synchronised). Finally the step arm is compared with
its own forwards (their mean time at that batch size, timed during the arm): the same machine
speed by construction, so this ratio shows what the engine's own work and the stalls between
waves (decode, prompt encoding) cost, without the shared machine's drift. Model FLOPs
utilisation: the denoiser's FLOPs per image and step (counted once by `FlopCounterMode` at the
ceiling's rows) times the images/s x steps of the step arm and of the ceiling, over the device's
peak (`--peak-tflops`, or the datasheet's for H100 / H200 / A100 in bf16 / fp16).

Usage:
    python benchmarks/serving.py --concurrency 16 --steps 20              # built-in model
    python benchmarks/serving.py --request-rate auto --num-requests 64
    python benchmarks/serving.py --model diffserve/models/digits_video/weights --num-frames 9 --concurrency 8
      (the built-in video model; add --no-context-folding to serve its 512 padded prompt rows
      one by one and compare)
    python benchmarks/serving.py --model DIR --load-format dummy --steps 4 --concurrency 4
      (DIR: any folder of a pipeline class diffserve serves; with dummy only its configs and
      tokenizers are read, so a weightless copy of a large model's folder benchmarks its
      architecture, e.g. benchmarks/sd3_config_folder.py, benchmarks/flux_config_folder.py,
      benchmarks/wan_config_folder.py with --num-frames for a video model)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import diffusers
import numpy as np
import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams
from diffserve.entrypoints.cli_args import parse_size
from diffserve.pipelines.registry import adapter_class
from diffserve.models.model_index import pipeline_config
from diffserve.runner.loader import load_components
from diffserve.runner.model_runner import ModelRunner
from diffserve.pipelines.base import AdapterOptions, RequestState
from diffserve.core.sampling_params import RequestLimits
from diffserve.core.errors import DeadlineUnmeetableError

PROMPTS = [
    "a handwritten digit {d}", "the number {w}", "digit {d}", "{d}", "handwritten {w}",
]
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@dataclass
class Job:
    """One request of the workload: arrival offset (s), prompt and sampling params."""

    arrival_s: float
    prompt: str
    params: SamplingParams


def _size(text: str) -> tuple[int, int]:
    """``--size``: ``WIDTHxHEIGHT`` or one square side -> (height, width) pixels."""
    if "x" in text.lower():
        width, height = parse_size(text)
        return height, width
    return int(text), int(text)


def make_workload(args, spec) -> list[Job]:
    """Seeded workload: prompts, seeds, step counts, sizes and (open loop) Poisson arrivals."""
    rng = random.Random(args.seed)
    jobs, t = [], 0.0
    f = spec.resolution_factor
    for i in range(args.num_requests):
        d = rng.randrange(10)
        prompt = rng.choice(PROMPTS).format(d=d, w=WORDS[d])
        if args.unique_prompts:  # every request its own text (`fresh` renames them per arm run)
            prompt = f"{prompt}, sample {i}"
        steps = args.steps if not args.mixed_steps else rng.choice([args.steps // 2, args.steps, args.steps * 2])
        h, w = args.size or (spec.default_height, spec.default_width)
        if args.mixed_sizes:  # smaller variants: always within the model's maximum size
            h, w = rng.choice([(h, w), (max(f, h - 2 * f), w), (h, max(f, w - 2 * f))])
        if args.request_rate:
            t += rng.expovariate(args.request_rate)
        jobs.append(Job(t, prompt, SamplingParams(num_inference_steps=steps, guidance_scale=args.guidance,
                                                  seed=args.seed + i, height=h, width=w, output_type="np",
                                                  num_frames=args.num_frames)))
    return jobs


@dataclass
class ArmResult:
    name: str
    latencies: list[float]
    makespan_s: float
    images: int
    batch_rows: list[int]

    @property
    def throughput(self) -> float:
        return self.images / self.makespan_s


def _pct(values, q):
    return float(np.percentile(values, q)) if values else float("nan")


def run_baseline(pipe: diffusers.DiffusionPipeline, jobs: list[Job], concurrency: int | None) -> ArmResult:
    """diffusers, one request at a time in arrival order (open loop: waits for arrivals)."""
    start = time.perf_counter()
    latencies, finish_times, free_at = [], [], 0.0
    for i, job in enumerate(jobs):
        if concurrency:  # closed loop: job i is sent when job i-concurrency finished
            arrival = 0.0 if i < concurrency else finish_times[i - concurrency]
        else:
            arrival = job.arrival_s
        now = time.perf_counter() - start
        if arrival > now:
            time.sleep(arrival - now)
        p = job.params
        extra = {} if p.guidance_scale is None else {"guidance_scale": p.guidance_scale}
        if p.num_frames is not None:
            extra["num_frames"] = p.num_frames
        pipe(job.prompt, num_inference_steps=p.num_inference_steps, height=p.height, width=p.width,
             generator=torch.Generator().manual_seed(p.seed), output_type="np", **extra)
        free_at = time.perf_counter() - start
        latencies.append(free_at - arrival)
        finish_times.append(free_at)
    return ArmResult("diffusers (one at a time)", latencies, free_at, len(jobs), [])


def run_static_batches(pipe: diffusers.DiffusionPipeline, jobs: list[Job], concurrency: int | None,
                       batch_size: int) -> ArmResult:
    """diffusers with static batches: whenever idle, one pipeline call on every request that
    has arrived (up to `batch_size`, a list of prompts with one generator each), run to
    completion; the workload must share steps and size (a static batch has one of each)."""
    start = time.perf_counter()
    latencies, finish_times, free_at, i = [], [0.0] * len(jobs), 0.0, 0
    arrivals = [0.0] * len(jobs)
    while i < len(jobs):
        if concurrency:  # closed loop: job j is sent when job j-concurrency finished
            for j in range(i, min(len(jobs), i + batch_size)):
                arrivals[j] = 0.0 if j < concurrency else finish_times[j - concurrency]
        else:
            for j in range(i, len(jobs)):
                arrivals[j] = jobs[j].arrival_s
        now = time.perf_counter() - start
        if arrivals[i] > now:
            time.sleep(arrivals[i] - now)
            now = time.perf_counter() - start
        batch = [j for j in range(i, min(len(jobs), i + batch_size)) if arrivals[j] <= now]
        p = jobs[i].params
        extra = {} if p.guidance_scale is None else {"guidance_scale": p.guidance_scale}
        if p.num_frames is not None:
            extra["num_frames"] = p.num_frames
        pipe([jobs[j].prompt for j in batch], num_inference_steps=p.num_inference_steps, height=p.height,
             width=p.width, generator=[torch.Generator().manual_seed(jobs[j].params.seed) for j in batch],
             output_type="np", **extra)
        free_at = time.perf_counter() - start
        for j in batch:
            finish_times[j] = free_at
            latencies.append(free_at - arrivals[j])
        i = batch[-1] + 1
    return ArmResult("diffusers (static batches)", latencies, free_at, len(jobs), [])


def run_engine(engine: DiffusionEngine, name: str, jobs: list[Job], concurrency: int | None) -> ArmResult:
    """Drive a diffserve engine with the workload, stepping it in this thread."""
    start = time.perf_counter()
    arrival, finish = {}, {}
    next_job, done, rows_seen = 0, 0, []
    while done < len(jobs):
        now = time.perf_counter() - start
        while next_job < len(jobs):
            outstanding = next_job - done
            if concurrency:
                if outstanding >= concurrency:
                    break
            elif jobs[next_job].arrival_s > now:
                break
            job = jobs[next_job]
            rid = engine.add_request(job.prompt, job.params)
            arrival[rid] = now if concurrency else job.arrival_s
            next_job += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, jobs[next_job].arrival_s - (time.perf_counter() - start)))
            continue
        for event in engine.step():
            if event.type.is_final:
                assert event.output.ok, event.output.error
                finish[event.request_id] = time.perf_counter() - start
                done += 1
                rows_seen.extend(k for k, v in event.output.metrics.batch_sizes.items() for _ in range(v))
    latencies = [finish[r] - arrival[r] for r in finish]
    return ArmResult(name, latencies, max(finish.values()), len(jobs), rows_seen)


def _forward_batch(runner: ModelRunner, rows: int, steps: int, size: tuple[int, int], num_frames: int | None):
    """A prepared `StepBatch` of `rows` denoiser rows of `size` (height, width) pixels: one
    request with `rows` images and guidance off."""
    adapter = runner.adapter
    no_cfg = 1.0 if adapter.spec.default_guidance_scale is not None else None
    params = SamplingParams(num_inference_steps=steps, guidance_scale=no_cfg, seed=0, num_images_per_prompt=rows,
                            height=size[0], width=size[1], num_frames=num_frames)
    limits = RequestLimits(max_num_images_per_prompt=rows, max_pixels=runner.config.max_pixels,
                           max_num_inference_steps=runner.config.max_num_inference_steps)
    state = RequestState("bench", "a handwritten digit 3", params.resolve(adapter.spec, limits))
    with torch.inference_mode():
        adapter.prepare(state)
    return adapter.collate([state])


def forward_flops(runner: ModelRunner, rows: int, steps: int, size: tuple[int, int],
                  num_frames: int | None = None) -> int:
    """Model FLOPs of one denoiser forward at `rows` rows of `size` pixels, counted by
    `torch.utils.flop_counter.FlopCounterMode` (matrix multiplies, convolutions and attention,
    2 FLOPs per multiply-add: the count model FLOPs utilisation uses, as in Chowdhery et al.
    2022, "PaLM", appendix B)."""
    from torch.utils.flop_counter import FlopCounterMode

    batch = _forward_batch(runner, rows, steps, size, num_frames)
    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        runner.adapter.denoise(batch)
    return int(counter.get_total_flops())


#: Peak dense tensor-core TFLOP/s in bf16 / fp16 (NVIDIA datasheets, SXM parts), by device-name substring.
PEAK_TFLOPS_16BIT = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def known_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The datasheet peak of `device` for `dtype` (bf16 / fp16 on the GPUs of
    `PEAK_TFLOPS_16BIT`), else None."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS_16BIT.items() if k in name), None)


def time_forward(runner: ModelRunner, rows: int, steps: int, size: tuple[int, int], forwards: int = 9,
                 num_frames: int | None = None, median: bool = False, denoise=None) -> float:
    """Seconds per bare denoiser forward at `rows` rows of `size` (height, width) pixels (no
    engine, no scheduler step), after one warm-up: the total time of `forwards` back-to-back
    forwards divided by their number (a throughput, measured as the arms' are: slow spells
    count), or with `median` the median forward. `denoise` replaces ``adapter.denoise`` (e.g. a
    runner's ``accelerator.denoise``, CUDA graphs); on CUDA the device is synchronised around
    each forward."""
    denoise = denoise or runner.adapter.denoise
    batch = _forward_batch(runner, rows, steps, size, num_frames)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        denoise(batch)
        sync()
        for _ in range(forwards):
            t = time.perf_counter()
            denoise(batch)
            sync()
            times.append(time.perf_counter() - t)
    return statistics.median(times) if median else sum(times) / len(times)


def _recorded_forwards(adapter, into: list[tuple[int, float, float]]):
    """`adapter.denoise` (the class's) recording (rows, start, end) of each call into `into`
    (perf_counter seconds)."""
    denoise = type(adapter).denoise.__get__(adapter)

    def recorded(batch, *args, **kwargs):
        start = time.perf_counter()
        out = denoise(batch, *args, **kwargs)
        into.append((batch.num_rows, start, time.perf_counter()))
        return out

    return recorded


@dataclass
class OverheadPair:
    """One back-to-back pair of the batch-1 overhead measure (seconds): each side's time per
    step, and the gaps between consecutive denoiser forwards inside each run (end of one
    forward to the start of the next: everything a step does besides its forward)."""

    served: float
    bare: float
    served_gaps: list[float]
    bare_gaps: list[float]
    bare_forwards: list[float]


def _gaps(marks: list[tuple[int, float, float]]) -> list[float]:
    """Seconds from the end of each recorded forward to the start of the next."""
    return [b[1] - a[2] for a, b in zip(marks, marks[1:])]


def engine_overhead(runner: ModelRunner, engine: DiffusionEngine, steps: int, guidance: float | None,
                    size: tuple[int, int], num_frames: int | None = None, runs: int = 15) -> list[OverheadPair]:
    """`runs` pairs of one request (batch 1): diffserve s/step vs the bare adapter's collate +
    forward + guidance + scheduler step s/step, each pair run back to back, which one goes
    first alternating (so a drifting machine speed favours neither), with the gaps between
    their forwards."""
    params = SamplingParams(num_inference_steps=steps, guidance_scale=guidance, seed=0, output_type="latent",
                            height=size[0], width=size[1], num_frames=num_frames)
    adapter = runner.adapter

    def bare() -> float:
        state = RequestState("bare", "digit 5", params.resolve(adapter.spec, runner.config.limits))
        with torch.inference_mode():
            adapter.prepare(state)
            t = time.perf_counter()
            while not state.done:
                batch = adapter.collate([state])
                adapter.step(batch, adapter.combine(batch, adapter.denoise(batch)))
            return (time.perf_counter() - t) / steps

    def served() -> float:
        [out] = engine.generate("digit 5", params)
        return out.metrics.denoise_s / steps

    pairs = []
    for i in range(runs):
        marks = {"served": [], "bare": []}
        order = ("bare", "served") if i % 2 else ("served", "bare")
        times = {}
        for arm in order:
            adapter.denoise = _recorded_forwards(adapter, marks[arm])
            try:
                times[arm] = (served if arm == "served" else bare)()
            finally:
                adapter.__dict__.pop("denoise", None)
        pairs.append(OverheadPair(times["served"], times["bare"], _gaps(marks["served"]), _gaps(marks["bare"]),
                                  [end - start for _, start, end in marks["bare"]]))
    return pairs


# ---------------------------------------------------------------------- trace mode (issue 27)
@dataclass
class TraceJob:
    """One request of a trace: arrival offset (s; None = drawn at the replayed load), prompt,
    size, steps, priority, deadline (s from arrival; None = none) and, with `--slo-scales`, its
    solo latency (s: alone on the engine at its size and steps; None = not measured)."""

    arrival_s: float | None
    prompt: str
    height: int
    width: int
    steps: int
    priority: int = 0
    deadline_s: float | None = None
    solo_s: float | None = None


def builtin_trace(args, spec, step_s: float) -> list[TraceJob]:
    """The built-in mix: sizes drawn from a weighted mix of the model's size and smaller ones
    (40% full, 25% half height, 20% half width, 15% quarter area), step counts (60% `--steps`,
    40% half), two SLO classes (30% interactive: priority 0, deadline `--slo-tight` x its steps
    x `step_s`; 70% batch: priority 1, deadline `--slo-loose` x the same). `step_s`: the seconds
    of a full-batch step (measured by the capacity probe)."""
    rng = random.Random(args.seed)
    f = spec.resolution_factor
    h, w = args.size or (spec.default_height, spec.default_width)
    half_h, half_w = max(f, (h // 2) // f * f), max(f, (w // 2) // f * f)
    sizes = [((h, w), 0.40), ((half_h, w), 0.25), ((h, half_w), 0.20), ((half_h, half_w), 0.15)]
    jobs = []
    for i in range(args.num_requests):
        (height, width), = rng.choices([s for s, _ in sizes], weights=[p for _, p in sizes])
        steps = args.steps if rng.random() < 0.6 else max(1, args.steps // 2)
        interactive = rng.random() < 0.3
        factor = args.slo_tight if interactive else args.slo_loose
        d = rng.randrange(10)
        jobs.append(TraceJob(None, rng.choice(PROMPTS).format(d=d, w=WORDS[d]), height, width, steps,
                             priority=0 if interactive else 1, deadline_s=factor * steps * step_s))
    return jobs


def load_trace(path: str) -> list[TraceJob]:
    """A trace file: one JSON object per line with ``prompt``, ``height``, ``width``, ``steps``
    and optionally ``arrival_s`` (else Poisson at the replayed load), ``priority``,
    ``deadline_s``."""
    jobs = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            jobs.append(TraceJob(row.get("arrival_s"), row["prompt"], int(row["height"]), int(row["width"]),
                                 int(row["steps"]), int(row.get("priority", 0)), row.get("deadline_s")))
    return jobs


def _at_rate(jobs: list[TraceJob], rate: float | None, seed: int) -> list[TraceJob]:
    """The jobs with Poisson arrivals at `rate` requests/s where a job has none (None: all at 0,
    for closed-loop replays)."""
    rng, t, out = random.Random(seed + 1), 0.0, []
    for job in jobs:
        if rate:
            t += rng.expovariate(rate)
        out.append(dataclasses.replace(job, arrival_s=job.arrival_s if job.arrival_s is not None else t))
    return out


def replay(engine: DiffusionEngine, jobs: list[TraceJob], concurrency: int | None, guidance: float | None,
           seed: int, scales: list[float] = ()) -> dict:
    """Replay `jobs` on `engine` (open loop at their arrivals, or closed loop at `concurrency`),
    stepping it in this thread. Returns pixels/s, requests/s, mean rows and tokens per forward
    (the engine's counters over the replay), SLO attainment (finished within deadline_s /
    requests with one; a request the engine refused, ``--admission slo``, counts as a miss),
    the longest queue wait, latency percentiles, the padded share of the forwards' image token
    slots and the refusals. For each of `scales` (with the jobs' `solo_s`), also
    ``attainment_x{scale}`` (finished within scale x solo_s, over all jobs) and
    ``goodput_x{scale}`` (those requests per second of the replay): a policy that ignores
    deadlines is judged at every scale from one replay."""
    before = engine.stats()["scheduler"]
    start = time.perf_counter()
    arrival, finish, queue, by_id = {}, {}, {}, {}
    refused: list[TraceJob] = []
    next_job = done = 0
    while done < len(jobs):
        now = time.perf_counter() - start
        while next_job < len(jobs):
            job = jobs[next_job]
            if concurrency:
                if next_job - done >= concurrency:
                    break
            elif job.arrival_s > now:
                break
            params = SamplingParams(num_inference_steps=job.steps, guidance_scale=guidance, seed=seed + next_job,
                                    height=job.height, width=job.width, output_type="latent",
                                    priority=job.priority, deadline_s=job.deadline_s)
            next_job += 1
            try:
                rid = engine.add_request(job.prompt, params)
            except DeadlineUnmeetableError:  # --admission slo: a miss, answered at once
                refused.append(job)
                done += 1
                continue
            arrival[rid], by_id[rid] = (now if concurrency else job.arrival_s), job
        if not engine.has_unfinished_requests():
            if next_job < len(jobs) and not concurrency:
                time.sleep(max(0.0, jobs[next_job].arrival_s - (time.perf_counter() - start)))
            continue
        for event in engine.step():
            if event.type.is_final:
                assert event.output.ok, event.output.error
                finish[event.request_id] = time.perf_counter() - start
                queue[event.request_id] = event.output.metrics.queue_s
                done += 1
    after = engine.stats()["scheduler"]
    forwards = after["forwards"] - before["forwards"]

    def per_forward(key: str) -> float:
        total = after[key] * after["forwards"] - before[key] * before["forwards"]
        return total / forwards if forwards else 0.0

    makespan = max(finish.values()) - min(arrival.values()) if finish else float("inf")
    latency = {r: finish[r] - arrival[r] for r in finish}
    judged = [r for r in finish if by_id[r].deadline_s is not None]
    met = [r for r in judged if latency[r] <= by_id[r].deadline_s]
    judged_count = len(judged) + sum(j.deadline_s is not None for j in refused)
    sweep = {}
    for scale in scales:
        within = sum(latency[r] <= scale * by_id[r].solo_s for r in finish if by_id[r].solo_s is not None)
        sweep[f"attainment_x{scale:g}"] = within / len(jobs)
        sweep[f"goodput_x{scale:g}"] = within / makespan
    return {"pixels_per_s": sum(by_id[r].height * by_id[r].width for r in finish) / makespan,
            "requests_per_s": len(finish) / makespan,
            "rows_per_forward": per_forward("mean_rows_per_forward"),
            "tokens_per_forward": per_forward("mean_tokens_per_forward"),
            "slo_attainment": len(met) / judged_count if judged_count else None,
            "max_queue_s": max(queue.values(), default=0.0), "p50_latency_s": _pct(list(latency.values()), 50),
            "p99_latency_s": _pct(list(latency.values()), 99),
            "preemptions": after["preemptions"] - before["preemptions"],
            "padded_token_share": padded_share(before, after), "refused": len(refused), **sweep}


def padded_share(before: dict, after: dict) -> float:
    """The padded share of the image token slots of the forwards between two scheduler stats."""
    def totals(s: dict) -> tuple[float, float]:
        tokens = s["mean_tokens_per_forward"] * s["forwards"]
        share = s.get("padded_token_share", 0.0)
        return tokens, tokens / (1.0 - share) if share < 1.0 else tokens
    (t0, s0), (t1, s1) = totals(before), totals(after)
    return 1.0 - (t1 - t0) / (s1 - s0) if s1 > s0 else 0.0


#: Trace-mode arms: (batching of sizes, scheduling policy, max_padding_ratio, admission);
#: ``mixed_padR`` is mixed sizes under FCFS with the padding cap R (e.g. ``mixed_pad0.25``, ``mixed_padauto``).
TRACE_ARMS = {"per_size": (False, "fcfs", 1.0, "all"), "mixed": (True, "fcfs", 1.0, "all"),
              "mixed_slo": (True, "slo", 1.0, "all"), "mixed_slo_adm": (True, "slo", 1.0, "slo")}


def trace_arm(arm: str) -> tuple[bool, str, float, str]:
    """(batching of sizes, policy, max_padding_ratio, admission) of a trace arm name
    (``mixed_padded``: ``mixed`` with its forwards over the padded rows, no length groups; any
    arm with the suffix ``_nojoin``: the same without the request scheduler's join wait)."""
    arm = arm.removesuffix("_nojoin")
    if arm == "mixed_padded":
        return TRACE_ARMS["mixed"]
    if arm.startswith("mixed_pad"):
        ratio = arm[len("mixed_pad"):]
        return True, "fcfs", ratio if ratio == "auto" else float(ratio), "all"
    return TRACE_ARMS[arm]


def check_trace_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit with a usage error naming the flag (``parser.error``, exit status 2) when a trace
    flag holds a bad value: ``--trace-loads`` / ``--slo-scales`` not comma-separated positive
    finite numbers, ``--padding-ratios`` not numbers in [0, 1] or ``auto``, or a
    ``--trace-arms`` name that `trace_arm` does not know."""
    for flag, text in (("--trace-loads", args.trace_loads), ("--slo-scales", args.slo_scales)):
        for item in (x.strip() for x in text.split(",") if x.strip()):
            try:
                value = float(item)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                parser.error(f"argument {flag}: invalid value {item!r}: must be a positive finite number")
    for item in (x.strip() for x in args.padding_ratios.split(",") if x.strip()):
        try:
            ok = item == "auto" or 0.0 <= float(item) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            parser.error(f"argument --padding-ratios: invalid value {item!r}: must be a number in [0, 1] or 'auto'")
    for arm in args.trace_arms.split(","):
        try:
            ratio = trace_arm(arm)[2]
            ok = ratio == "auto" or 0.0 <= ratio <= 1.0
        except (KeyError, ValueError):
            ok = False
        if not ok:
            parser.error(f"argument --trace-arms: invalid arm {arm!r}: choose from {', '.join(TRACE_ARMS)} "
                         "or mixed_padR (R in [0, 1] or auto), each optionally with the suffix _nojoin")


def solo_latencies(engine_for, jobs: list[TraceJob], guidance: float | None, seed: int,
                   rounds: int = 5) -> dict[tuple[int, int, int], float]:
    """Solo latency of each (height, width, steps) of `jobs`: the median of `rounds` requests
    sent alone (closed loop at concurrency 1) to a fresh per-size FCFS engine, in seconds from
    `add_request` to the final event (output_type latent, as in the replays). The sizes take
    turns, one request each per round, so a slow spell of a shared machine spreads over all of
    them instead of inflating one."""
    keys = sorted({(j.height, j.width, j.steps) for j in jobs})
    probe = {key: dataclasses.replace(next(j for j in jobs if (j.height, j.width, j.steps) == key),
                                      arrival_s=0.0, deadline_s=None) for key in keys}
    times: dict[tuple[int, int, int], list[float]] = {key: [] for key in keys}
    for _ in range(rounds):
        for key in keys:
            times[key].append(replay(engine_for("per_size"), [probe[key]], 1, guidance, seed)["p50_latency_s"])
    return {key: statistics.median(values) for key, values in times.items()}


def with_deadlines(jobs: list[TraceJob], scale: float) -> list[TraceJob]:
    """`jobs` with deadline_s = `scale` x solo_s (the SLO scale sweep; every class alike)."""
    return [dataclasses.replace(j, deadline_s=scale * j.solo_s) for j in jobs]


def run_trace(args, config: EngineConfig, runner: ModelRunner) -> dict:
    """Trace mode (issue 27): a closed-loop part (pixels/s of the mixed-size workload vs the same
    workload at one size, rows per forward per-size vs mixed; where the model runs mixed
    forwards per length group, also ``closed/mixed_padded``: the same mixed batches with every
    forward over the padded rows, `PipelineAdapter.length_groups` off) and an
    open-loop part (Poisson arrivals at each of `--trace-loads` x the per-size FCFS capacity,
    measured once before the repeats or, with `--capacity-per-repeat`, by each repeat's own
    ``closed/per_size`` run, which then goes first, and then also sets that repeat's deadlines
    (solo latencies measured again, or the built-in classes' full-batch step at that capacity);
    arms `--trace-arms`), every part `--repeats` times with its arms interleaved.

    With `--slo-scales`, every request's deadline is scale x its own solo latency (measured
    first, `solo_latencies`), swept over the scales: the FCFS arms ignore deadlines, so one
    replay of each is judged at every scale; the slo arms run once per scale
    (``load{L}/{arm}@x{scale}``)."""
    spec = runner.adapter.spec
    concurrency = args.concurrency or 16
    scales = [float(x) for x in args.slo_scales.split(",") if x.strip()]

    def engine_for(arm: str) -> DiffusionEngine:
        mixed, policy, ratio, admission = trace_arm(arm)
        runner.adapter.mixed_sizes = mixed and runner._mixed_capable  # read by batch_key and prepare
        runner.adapter.length_groups = runner._groups_capable and arm != "mixed_padded"  # read per forward
        engine = DiffusionEngine(dataclasses.replace(config, scheduling_policy=policy, aging_s=args.aging_s,
                                                     max_padding_ratio=ratio, admission=admission), runner=runner)
        if arm.endswith("_nojoin"):
            engine.scheduler.join_wait_fraction = 0.0
        return engine

    runner._mixed_capable = bool(runner.adapter.mixed_sizes)
    runner._groups_capable = runner.adapter.grouping()
    # capacity probe: per-size FCFS, closed loop, on the mix with placeholder deadlines
    probe_jobs = _at_rate(builtin_trace(args, spec, 1.0) if not args.trace or args.trace == "builtin"
                          else load_trace(args.trace), None, args.seed)
    probe_engine = engine_for("per_size")
    probe = replay(probe_engine, probe_jobs, concurrency, args.guidance, args.seed)
    capacity = probe["requests_per_s"]
    full_rows = max(probe["rows_per_forward"], 1.0)
    builtin = not args.trace or args.trace == "builtin"
    mean_steps = sum(j.steps for j in probe_jobs) / len(probe_jobs)

    def full_step_s(rate: float) -> float:  # seconds of a full-batch step at `rate` req/s, closed loop
        return 1.0 / (rate * mean_steps / max(concurrency, 1)) if rate else 0.0

    def timed(trace: list[TraceJob]) -> tuple[list[TraceJob], dict]:  # solo latencies measured now, as deadlines
        solo = solo_latencies(engine_for, trace, args.guidance, args.seed)
        return with_deadlines([dataclasses.replace(j, solo_s=solo[(j.height, j.width, j.steps)])
                               for j in trace], scales[0]), solo

    step_s = full_step_s(capacity)
    jobs = builtin_trace(args, spec, step_s) if builtin else load_trace(args.trace)
    if scales:
        jobs, solo = timed(jobs)
        print("solo latency (s) by height x width, steps: " + ", ".join(
            f"{h}x{w},{n}: {v:.4f}" for (h, w, n), v in solo.items()))
    one = one_size_of(jobs, spec)
    one_size = [dataclasses.replace(j, height=one[0], width=one[1]) for j in jobs]
    print(f"trace: {len(jobs)} requests; per-size FCFS capacity {capacity:.2f} req/s at concurrency {concurrency} "
          f"({full_rows:.1f} rows/forward); step {step_s * 1000:.1f} ms; aging bound {args.aging_s:g} s; "
          f"one-size workload at {one[0]}x{one[1]} (height x width)")
    results: dict[str, list[dict]] = {}
    loads = [float(x) for x in args.trace_loads.split(",") if x.strip()]
    pads = [f"mixed_pad{r.strip() if r.strip() == 'auto' else format(float(r), 'g')}"
            for r in args.padding_ratios.split(",") if r.strip()]
    capacities: list[float] = []  # the req/s each repeat's open-loop rates are fractions of
    speeds: list[float] = []  # per repeat: its deadlines over the first measure's (solo latency or step)

    def run_one(repeat: int, name: str, arm: str, arm_jobs: list[TraceJob], judge) -> dict:
        closed_loop = name.startswith("closed")
        result = replay(engine_for(arm), _at_rate(arm_jobs, None, 0) if closed_loop else arm_jobs,
                        concurrency if closed_loop else None, args.guidance, args.seed, judge)
        results.setdefault(name, []).append(result)
        print(f"  repeat {repeat} {name:22s} " + " ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
        return result

    for repeat in range(args.repeats):
        closed = [("closed/per_size", "per_size", jobs), ("closed/mixed", "mixed", jobs),
                  *[(f"closed/{pad}", pad, jobs) for pad in pads], ("closed/one_size", "mixed", one_size),
                  *([("closed/mixed_padded", "mixed_padded", jobs)] if runner._groups_capable else [])]
        rate, timed_jobs = capacity, jobs
        if args.capacity_per_repeat:  # this repeat's own per-size capacity, measured right before its arms,
            rate = run_one(repeat, *closed.pop(0), ())["requests_per_s"] or capacity
            if scales:  # and its deadlines: scale x the solo latencies measured now
                timed_jobs, solo_now = timed(jobs)
                speeds.append(statistics.median(solo_now[k] / solo[k] for k in solo))
            elif builtin:  # the classes' deadlines in full-batch steps at this repeat's capacity
                timed_jobs = builtin_trace(args, spec, full_step_s(rate))
                speeds.append(full_step_s(rate) / step_s if step_s else 1.0)
        capacities.append(rate)
        opened = []
        for load in loads:
            for arm in args.trace_arms.split(","):
                arrivals = _at_rate(timed_jobs, load * rate, args.seed + repeat)
                if scales and trace_arm(arm)[1] != "fcfs":  # deadlines steer it: one replay per scale
                    opened += [(f"load{load:g}/{arm}@x{scale:g}", arm, with_deadlines(arrivals, scale), [scale])
                               for scale in scales]
                else:
                    opened.append((f"load{load:g}/{arm}", arm, arrivals, scales))
        runs = [(*c, ()) for c in closed] + opened
        if repeat % 2:
            runs = runs[::-1]
        for name, arm, arm_jobs, judge in runs:
            run_one(repeat, name, arm, arm_jobs, judge)
    runner.adapter.mixed_sizes = runner._mixed_capable
    runner.adapter.length_groups = runner._groups_capable
    summary = {name: {k: _median_range([r[k] for r in runs]) for k in runs[0]} for name, runs in results.items()}

    def ratio(a: str, b: str, key: str) -> list:
        return _median_range([x[key] / y[key] for x, y in zip(results[a], results[b]) if y[key]])

    summary["targets"] = {
        "mixed_vs_one_size_pixels_per_s": ratio("closed/mixed", "closed/one_size", "pixels_per_s"),
        "mixed_vs_per_size_rows_per_forward": ratio("closed/mixed", "closed/per_size", "rows_per_forward"),
        "per_size_vs_one_size_pixels_per_s": ratio("closed/per_size", "closed/one_size", "pixels_per_s"),
    }
    if runner._groups_capable:
        summary["targets"]["mixed_vs_mixed_padded_pixels_per_s"] = ratio("closed/mixed", "closed/mixed_padded",
                                                                         "pixels_per_s")
        summary["targets"]["mixed_padded_vs_one_size_pixels_per_s"] = ratio("closed/mixed_padded",
                                                                            "closed/one_size", "pixels_per_s")
    for pad in pads:
        summary["targets"][f"{pad}_vs_one_size_pixels_per_s"] = ratio(f"closed/{pad}", "closed/one_size",
                                                                      "pixels_per_s")
        summary["targets"][f"{pad}_vs_per_size_rows_per_forward"] = ratio(f"closed/{pad}", "closed/per_size",
                                                                          "rows_per_forward")
        summary["targets"][f"{pad}_vs_mixed_pixels_per_s"] = ratio(f"closed/{pad}", "closed/mixed", "pixels_per_s")
    if pads:
        summary["targets"]["per_size_vs_mixed_pixels_per_s"] = ratio("closed/per_size", "closed/mixed",
                                                                     "pixels_per_s")
    for load in loads:
        base, slo = f"load{load:g}/per_size", f"load{load:g}/mixed_slo"
        if base in results and slo in results:
            summary["targets"][f"load{load:g}_slo_points_over_per_size"] = _median_range(
                [100 * ((s["slo_attainment"] or 0) - (b["slo_attainment"] or 0))
                 for s, b in zip(results[slo], results[base])])
    if scales:
        summary["slo_sweep"] = slo_sweep(results, loads, scales, args.trace_arms.split(","))
    print("medians [min, max]:")
    for name, values in summary.items():
        if name == "slo_sweep":
            continue
        print(f"  {name}: " + ", ".join(f"{k}={v[0]:.3g} [{v[1]:.3g}, {v[2]:.3g}]" for k, v in values.items()
                                        if v[0] is not None))
    if scales:
        print("SLO attainment by scale x solo latency, median [min, max] of the repeats:")
        for row in summary["slo_sweep"]:
            print("  " + " ".join(f"{k}={_fmt(v)}" for k, v in row.items()))
    if args.capacity_per_repeat:
        print("capacity by repeat (req/s): " + ", ".join(f"{c:.1f}" for c in capacities))
        if speeds:
            print("deadlines by repeat, over the first measure's: " + ", ".join(f"{x:.2f}x" for x in speeds))
    return {"capacity_req_per_s": capacity, "capacity_by_repeat": capacities, "deadline_factor_by_repeat": speeds,
            "step_s": step_s, "aging_s": args.aging_s,
            "solo_s": {f"{h}x{w},{n}": v for (h, w, n), v in solo.items()} if scales else None, **summary}


def slo_sweep(results: dict[str, list[dict]], loads: list[float], scales: list[float], arms: list[str]) -> list[dict]:
    """One row per (load, scale): each arm's attainment and goodput at that scale (median, min,
    max over the repeats; an slo arm from its own replay at that scale) and the points of each
    slo arm over ``per_size`` (paired by repeat)."""
    rows = []
    for load in loads:
        for scale in scales:
            row: dict = {"load": load, "scale": scale}
            key = f"x{scale:g}"
            series = {}
            for arm in arms:
                runs = results.get(f"load{load:g}/{arm}@{key}") or results.get(f"load{load:g}/{arm}")
                if runs:
                    series[arm] = runs
                    row[f"{arm}_attainment"] = _median_range([r[f"attainment_{key}"] for r in runs])
                    row[f"{arm}_goodput"] = _median_range([r[f"goodput_{key}"] for r in runs])
                    if trace_arm(arm)[3] == "slo":
                        row[f"{arm}_refused"] = _median_range([r["refused"] for r in runs])
            for arm in series:
                if arm != "per_size" and "per_size" in series:
                    row[f"{arm}_points_over_per_size"] = _median_range(
                        [100 * (a[f"attainment_{key}"] - b[f"attainment_{key}"])
                         for a, b in zip(series[arm], series["per_size"])])
            rows.append(row)
    return rows


def _fmt(value) -> str:
    """A number or a [median, min, max] list, 3 significant digits."""
    if isinstance(value, list):
        return f"{value[0]:.3g} [{value[1]:.3g}, {value[2]:.3g}]" if value[0] is not None else "-"
    return f"{value:g}"


def one_size_of(jobs: list[TraceJob], spec) -> tuple[int, int]:
    """The one size of "the same workload with one size": the valid (height, width) (multiples of
    the resolution factor, within the jobs' largest) whose area is closest to the jobs' mean
    area, the squarest on ties, so both workloads hold about the same pixels."""
    f = spec.resolution_factor
    mean = sum(j.height * j.width for j in jobs) / len(jobs)
    top_h, top_w = max(j.height for j in jobs), max(j.width for j in jobs)
    sizes = [(h, w) for h in range(f, top_h + 1, f) for w in range(f, top_w + 1, f)]
    return min(sizes, key=lambda s: (abs(s[0] * s[1] - mean), abs(s[0] - s[1])))


def _median_range(values: list) -> list:
    """[median, min, max] of the non-None values ([None, None, None] when there are none)."""
    values = [v for v in values if v is not None]
    if not values:
        return [None, None, None]
    return [statistics.median(values), min(values), max(values)]


def load_runner(config: EngineConfig) -> tuple[str, dict, ModelRunner]:
    """Load `config`'s model folder once: (the pipeline class named in its model_index.json,
    its components in eval mode, a `ModelRunner` over them), so the diffusers baseline and every
    engine arm share the very same weights.

    Raises:
        UnsupportedModelError: the folder is missing or unreadable, or diffserve has no adapter
            for its pipeline class (from `load_components` / `adapter_class`)."""
    class_name, components = load_components(config.model_path, config.torch_dtype, config.load_format,
                                             device=config.torch_device)
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    options = AdapterOptions(context_folding=config.context_folding, model_dir=Path(config.model_path))
    adapter = adapter_class(class_name).from_components(components, config.torch_device, config.torch_dtype, options)
    return class_name, components, ModelRunner(config, adapter=adapter)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="default", choices=["default", "dummy"])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--request-rate", default=None, help="requests/s (Poisson) or 'auto'")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=None, help="guidance_scale (default: the model's)")
    ap.add_argument("--size", type=_size, default=None,
                    help="WIDTHxHEIGHT or a square side in pixels (default: the model's)")
    ap.add_argument("--num-frames", type=int, default=None, help="video models: frames (default: the model's)")
    ap.add_argument("--unique-prompts", action="store_true",
                    help="every request a distinct prompt (the prompt cache never hits, every arm encodes "
                         "every prompt; repeats use new prompts)")
    ap.add_argument("--mixed-steps", action="store_true")
    ap.add_argument("--mixed-sizes", action="store_true")
    ap.add_argument("--max-batch-size", type=int, default=32, help="transformer rows per step")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--arms", default="baseline,static,request,step",
                    help="comma list of baseline (diffusers one at a time), static (diffusers static "
                         "batches), request, step; also step_inline (step mode with prompt encoding and VAE "
                         "decode inline, overlap_stages=False: the engine before the executor's side "
                         "thread), step_encode_alone (step mode encoding each text alone, not the texts of "
                         "requests admitted together in one encoder forward), "
                         "step_cfg2 (2 worker processes, one CFG branch each), step_ulysses2 (2 "
                         "worker processes, Ulysses sequence parallel); the 2-rank arms give each rank "
                         "--threads / 2 torch threads (at least 1), so all arms use the same cores; "
                         "step_graphs (CUDA devices: step mode replaying the denoiser from CUDA graphs, "
                         "captured in a warm-up run of the workload; its forward is also timed against the "
                         "eager ceiling's: the launch overhead the graphs remove)")
    ap.add_argument("--compile", action="store_true", help="regional torch.compile in the diffserve arms")
    ap.add_argument("--no-context-folding", dest="context_folding", action="store_false",
                    help="diffserve arms: run the placeholder / padding context rows one by one "
                         "(EngineConfig.context_folding=False)")
    ap.add_argument("--cache-backend", default="none", choices=["none", "teacache", "cache_dit"])
    ap.add_argument("--cache-config", default="{}", help="JSON options of the cache backend")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every arm this many times, interleaved; report medians and ranges")
    ap.add_argument("--json", action="store_true", help="print a final machine-readable JSON line")
    ap.add_argument("--overhead-runs", type=int, default=15,
                    help="back-to-back pairs of the batch-1 overhead measure per repeat")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's peak dense TFLOP/s in the model dtype, for model FLOPs utilisation "
                         "(default: known for H100 / H200 / A100 in bf16 / fp16; else only achieved TFLOP/s)")
    ap.add_argument("--trace", default=None, metavar="FILE|builtin",
                    help="trace mode: replay a trace (JSON lines, see load_trace) or the built-in mix of sizes, "
                         "step counts and two SLO classes; arms --trace-arms at --trace-loads x capacity")
    ap.add_argument("--trace-loads", default="0.8,1.0",
                    help="trace mode: loads as fractions of capacity ('' = closed loop only)")
    ap.add_argument("--padding-ratios", default="",
                    help="trace mode: closed-loop arms mixed_padR, mixed sizes under FCFS with --max-padding-ratio "
                         "R, for each R of this comma-separated list (e.g. 0.25,0.5,auto; default: none)")
    ap.add_argument("--trace-arms", default="per_size,mixed,mixed_slo",
                    help="trace mode: per_size (batching by size, FCFS: before issue 27), mixed (mixed sizes, "
                         "FCFS), mixed_slo (mixed sizes, --scheduling-policy slo), mixed_slo_adm (mixed_slo with "
                         "--admission slo: refusals count as misses), mixed_padR (mixed sizes, FCFS, "
                         "--max-padding-ratio R)")
    ap.add_argument("--slo-tight", type=float, default=3.0,
                    help="trace mode: interactive deadline = this x its steps x a full-batch step")
    ap.add_argument("--slo-loose", type=float, default=12.0,
                    help="trace mode: batch-class deadline = this x its steps x a full-batch step")
    ap.add_argument("--slo-scales", default="",
                    help="trace mode: comma list of SLO scales (e.g. 1.5,2,3,5); each request's deadline is "
                         "scale x its own solo latency at its size and steps (measured first), replacing "
                         "--slo-tight / --slo-loose; attainment per arm per scale at each load (default: none)")
    ap.add_argument("--aging-s", type=float, default=60.0, help="trace mode: the slo arm's aging bound")
    ap.add_argument("--capacity-per-repeat", action="store_true",
                    help="trace mode: each repeat first runs closed/per_size and sets its open-loop rates to "
                         "--trace-loads x that run's requests/s (default: x the one capacity probe before the "
                         "repeats), and its deadlines to the speed measured then: with --slo-scales, scale x "
                         "solo latencies measured again right after that run; on the built-in trace without "
                         "them, the classes' full-batch steps at that capacity; on a host whose speed drifts "
                         "between repeats, each repeat's loads and deadlines then hold against the speed it "
                         "runs at")
    args = ap.parse_args()
    check_trace_args(ap, args)
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 16
    torch.set_num_threads(args.threads)
    arms = args.arms.split(",")

    config = EngineConfig(model=args.model, load_format=args.load_format, max_batch_size=args.max_batch_size,
                          max_waiting_requests=100_000, num_threads=args.threads, compile=args.compile,
                          context_folding=args.context_folding,
                          cache_backend=args.cache_backend, cache_config=json.loads(args.cache_config))
    class_name, components, runner = load_runner(config)
    if args.trace:
        DiffusionEngine(config, runner=runner).generate(["digit 1"] * 4, SamplingParams(num_inference_steps=2))
        result = run_trace(args, config, runner)
        if args.json:
            print(json.dumps(result))
        return
    pipe_class = getattr(diffusers, class_name)  # the folder's own diffusers pipeline class
    settings = {k: v for k, v in pipeline_config(config.model_path).items()  # e.g. Wan 2.2's boundary_ratio
                if k in inspect.signature(pipe_class).parameters}
    pipe = pipe_class(**components, **settings)
    pipe.set_progress_bar_config(disable=True)

    rate = args.request_rate
    if rate == "auto":
        probe_args = argparse.Namespace(**{**vars(args), "request_rate": None})
        probe = run_engine(DiffusionEngine(config, runner=runner), "probe", make_workload(probe_args, runner.adapter.spec),
                           args.concurrency or 16)
        rate = 0.8 * probe.throughput
        print(f"step-mode capacity {probe.throughput:.2f} req/s -> Poisson rate {rate:.2f} req/s (80%)")
    args.request_rate = float(rate) if rate else None
    concurrency = None if args.request_rate else args.concurrency
    jobs = make_workload(args, runner.adapter.spec)
    load = f"Poisson {args.request_rate:.2f} req/s" if args.request_rate else f"concurrency {concurrency}"
    print(f"model={config.model_path.name} load_format={args.load_format} device={config.torch_device} "
          f"threads={torch.get_num_threads()} requests={len(jobs)} steps={args.steps} guidance={args.guidance} "
          f"load={load} mixed_steps={args.mixed_steps} mixed_sizes={args.mixed_sizes} "
          f"max_batch_size={args.max_batch_size} compile={args.compile} cache_backend={args.cache_backend} "
          f"context_folding={bool(getattr(runner.adapter, 'context_folding', False))}")

    # warm up every path once
    side_h, side_w = jobs[0].params.height, jobs[0].params.width
    frames = {} if args.num_frames is None else {"num_frames": args.num_frames}
    pipe("digit 1", num_inference_steps=2, height=side_h, width=side_w, **frames)
    DiffusionEngine(config, runner=runner).generate(["digit 1"] * 4, SamplingParams(num_inference_steps=2,
                                                                                    height=side_h, width=side_w,
                                                                                    num_frames=args.num_frames))

    uniform = not (args.mixed_steps or args.mixed_sizes)
    if "static" in arms and not uniform:
        print("static-batch arm skipped: a static batch has one step count and size (mixed workload)")
        arms.remove("static")
    engines = {mode: DiffusionEngine(EngineConfig(**{**vars(config), "execution_mode": mode}), runner=runner)
               for mode in ("request", "step") if mode in arms}
    if "step_encode_alone" in arms:
        engines["step_encode_alone"] = DiffusionEngine(config, runner=runner)
    if "step_inline" in arms:
        engines["step_inline"] = DiffusionEngine(EngineConfig(**{**vars(config), "overlap_stages": False}),
                                                 runner=runner)
    graph_runner = None
    if "step_graphs" in arms:  # its own runner (graphs live in the accelerator), the same loaded adapter
        graph_config = EngineConfig(**{**vars(config), "cuda_graphs": True})
        graph_runner = ModelRunner(graph_config, adapter=runner.adapter)
        engines["step_graphs"] = DiffusionEngine(graph_config, runner=graph_runner)
        run_engine(engines["step_graphs"], "warm-up", jobs, concurrency)  # captures the buckets it uses
    per_rank = {"num_threads": max(1, args.threads // 2), "executor": "multiprocess"}
    for arm, sizes in (("step_cfg2", {"cfg_parallel_size": 2}), ("step_ulysses2", {"ulysses_degree": 2})):
        if arm in arms:  # worker processes of their own (own weights, loaded from the folder)
            engines[arm] = DiffusionEngine(EngineConfig(**{**vars(config), **per_rank, **sizes}))
            engines[arm].generate(["digit 1"] * 4, SamplingParams(num_inference_steps=2, height=side_h, width=side_w,
                                                                  num_frames=args.num_frames))
    runs: dict[str, list[ArmResult]] = {}
    size = (side_h, side_w)
    cfg_rows = runner.adapter.rows(jobs[0].params.resolve(runner.adapter.spec, config.limits, 0))
    ceilings: list[dict] = []  # per repeat: bare-forward throughput bracketing that repeat's step arm
    overheads: list[list[OverheadPair]] = []  # per repeat: diffserve vs bare adapter pairs, batch 1
    overhead_engine = DiffusionEngine(config, runner=runner)
    # the ceiling's forwards: as many as the step arm's steps at full batch (about as long as it)
    n_forwards = max(9, args.steps * -(-len(jobs) // (concurrency or 16)))
    guess_rows = min(args.max_batch_size, (concurrency or 16) * cfg_rows)
    runs_made = itertools.count()

    def fresh(jobs: list[Job]) -> list[Job]:
        """With --unique-prompts, prompts no earlier arm run used (no prompt-cache hits)."""
        if not args.unique_prompts:
            return jobs
        tag = next(runs_made)
        return [dataclasses.replace(j, prompt=f"{j.prompt} (run {tag})") for j in jobs]

    for _ in range(args.repeats):  # arms, the ceiling and the batch-1 overhead interleaved within each repeat
        if "baseline" in arms:
            runs.setdefault("diffusers", []).append(run_baseline(pipe, fresh(jobs), concurrency))
        if "static" in arms:
            runs.setdefault("diffusers_static_batch", []).append(
                run_static_batches(pipe, fresh(jobs), concurrency, concurrency or args.max_batch_size))
        for mode, engine in engines.items():
            before = None
            if mode == "step":
                before = time_forward(runner, guess_rows, args.steps, size, n_forwards, args.num_frames)
            text = runner.adapter.text
            batched = text is not None and text.batched
            if mode == "step_encode_alone" and text is not None:
                text.batched = False
            forwards: list[tuple[int, float, float]] = []  # step arm: (rows, start, end) of every denoiser forward
            if mode == "step":
                runner.adapter.denoise = _recorded_forwards(runner.adapter, forwards)
            try:
                runs.setdefault(mode, []).append(run_engine(engine, f"diffserve {mode} mode", fresh(jobs), concurrency))
            finally:
                if text is not None:
                    text.batched = batched
                runner.adapter.__dict__.pop("denoise", None)
            if mode == "step" and runs["step"][-1].batch_rows:
                rows = int(round(statistics.mean(runs["step"][-1].batch_rows)))
                after = time_forward(runner, rows, args.steps, size, n_forwards, args.num_frames)
                tb = (before + after) / 2 if rows == guess_rows else after
                t1 = time_forward(runner, cfg_rows, args.steps, size, num_frames=args.num_frames, median=True)
                ceiling = (rows / cfg_rows) / (args.steps * tb)
                throughput = runs["step"][-1].throughput
                at_rows = [end - start for n, start, end in forwards if n == rows]
                in_situ = (rows / cfg_rows) / (args.steps * statistics.mean(at_rows)) if at_rows else None
                ceilings.append({"rows": rows, "t1": t1, "tb": tb, "ceiling": ceiling, "ratio": throughput / ceiling,
                                 "in_situ_ratio": throughput / in_situ if in_situ else None})
                guess_rows = rows
        overheads.append(engine_overhead(runner, overhead_engine, args.steps, args.guidance, size, args.num_frames,
                                         runs=args.overhead_runs))

    def median_run(results: list[ArmResult]) -> ArmResult:
        return sorted(results, key=lambda r: r.throughput)[len(results) // 2]

    for engine in engines.values():
        if engine.config.cfg_parallel_size * engine.config.ulysses_degree > 1:
            engine.shutdown()
    names = {"diffusers": "diffusers (one at a time)", "diffusers_static_batch": "diffusers (static batches)",
             "request": "diffserve request mode", "step": "diffserve step mode",
             "step_inline": "step, encode/decode inline", "step_graphs": "step, CUDA graphs", "step_encode_alone": "step, texts encoded alone", "step_cfg2": "step, CFG-parallel 2 ranks",
             "step_ulysses2": "step, Ulysses 2 ranks"}
    base = median_run(runs["diffusers"]).throughput if "diffusers" in runs else None
    print(f"\n{'arm':28s} {'img/s':>8s} {'range':>15s} {'vs base':>8s} {'p50 s':>8s} {'p95 s':>8s} "
          f"{'p99 s':>8s} {'mean rows':>9s}   (median of {args.repeats})")
    for key, results in runs.items():
        r = median_run(results)
        lo, hi = min(x.throughput for x in results), max(x.throughput for x in results)
        ratio = f"{r.throughput / base:7.2f}x" if base else "     n/a"
        rows = f"{statistics.mean(r.batch_rows):9.1f}" if r.batch_rows else "      n/a"
        print(f"{names[key]:28s} {r.throughput:8.2f} {f'[{lo:.2f}, {hi:.2f}]':>15s} {ratio} {_pct(r.latencies, 50):8.2f} "
              f"{_pct(r.latencies, 95):8.2f} {_pct(r.latencies, 99):8.2f} {rows}")
    if "diffusers_static_batch" in runs and "step" in runs:
        print(f"step mode vs diffusers static batches: "
              f"{median_run(runs['step']).throughput / median_run(runs['diffusers_static_batch']).throughput:.2f}x")

    step_vs_ceiling, ratio_range, in_situ_ratio, in_situ_range = None, None, None, None
    if ceilings:
        ratios = [c["ratio"] for c in ceilings]
        step_vs_ceiling, ratio_range = statistics.median(ratios), [min(ratios), max(ratios)]
        c = sorted(ceilings, key=lambda c: c["ratio"])[len(ceilings) // 2]
        print(f"\nceiling (bare forwards right before and after each repeat's step arm, {n_forwards} each, "
              f"total time / count): {c['rows']} rows {c['tb'] * 1e3:.2f} ms, {cfg_rows} rows {c['t1'] * 1e3:.2f} ms "
              f"(median; {c['tb'] / c['t1']:.2f}x the cost for {c['rows'] / cfg_rows:.0f}x the images) -> "
              f"{c['ceiling']:.2f} img/s; step mode reaches {step_vs_ceiling:.1%} of it "
              f"[{ratio_range[0]:.1%}-{ratio_range[1]:.1%}] (median of {len(ratios)} repeats, each against its own "
              f"ceiling)")
        in_situ = [c["in_situ_ratio"] for c in ceilings if c["in_situ_ratio"] is not None]
        if in_situ:
            in_situ_ratio, in_situ_range = statistics.median(in_situ), [min(in_situ), max(in_situ)]
            print(f"against its own forwards (their mean time at {c['rows']} rows during the arm, so the same "
                  f"machine speed: what the engine's work and the stalls between waves cost): "
                  f"{in_situ_ratio:.1%} [{in_situ_range[0]:.1%}-{in_situ_range[1]:.1%}]")
    pair_ratios = [p.served / p.bare - 1 for pairs in overheads for p in pairs]
    per_repeat = [statistics.median(p.served / p.bare - 1 for p in pairs) for pairs in overheads]
    overhead, overhead_range = statistics.median(pair_ratios), [min(per_repeat), max(per_repeat)]
    served = statistics.median(p.served for pairs in overheads for p in pairs)
    bare = statistics.median(p.bare for pairs in overheads for p in pairs)
    print(f"engine overhead at batch 1: diffserve {served * 1e3:.3f} ms/step vs bare adapter "
          f"{bare * 1e3:.3f} ms/step (medians) -> {overhead:+.1%} (median of {len(pair_ratios)} back-to-back "
          f"pairs; per-repeat medians [{overhead_range[0]:+.1%}, {overhead_range[1]:+.1%}])")

    def between_forwards(pairs: list[OverheadPair]) -> tuple[float, float, float, float]:
        served_gap = statistics.median(g for p in pairs for g in p.served_gaps)
        bare_gap = statistics.median(g for p in pairs for g in p.bare_gaps)
        forward = statistics.median(f for p in pairs for f in p.bare_forwards)
        return (served_gap - bare_gap) / (forward + bare_gap), served_gap, bare_gap, forward

    gap_overhead, served_gap, bare_gap, forward = between_forwards([p for pairs in overheads for p in pairs])
    gap_per_repeat = [between_forwards(pairs)[0] for pairs in overheads]
    gap_range = [min(gap_per_repeat), max(gap_per_repeat)]
    print(f"same pairs, between forwards (each side's median gap from one forward's end to the next one's start, "
          f"so the forwards' own noise drops out): diffserve {served_gap * 1e6:.0f} us vs bare {bare_gap * 1e6:.0f} us "
          f"per step, forward {forward * 1e3:.3f} ms -> {gap_overhead:+.2%} of a bare step "
          f"(per-repeat [{gap_range[0]:+.2%}, {gap_range[1]:+.2%}])")
    graphs = None
    if graph_runner is not None and ceilings:  # the launch overhead CUDA graphs remove, at the ceiling's rows
        c = sorted(ceilings, key=lambda c: c["ratio"])[len(ceilings) // 2]
        eager = time_forward(runner, c["rows"], args.steps, size, n_forwards, args.num_frames)
        replay = time_forward(runner, c["rows"], args.steps, size, n_forwards, args.num_frames,
                              denoise=graph_runner.accelerator.denoise)
        graphs = {"rows": c["rows"], "eager_forward_s": eager, "graph_forward_s": replay,
                  "forward_time_removed": 1 - replay / eager,
                  "step_graphs_vs_ceiling": median_run(runs["step_graphs"]).throughput / c["ceiling"],
                  "stats": graph_runner.acceleration_stats()["cuda_graphs"]}
        print(f"CUDA graphs at {c['rows']} rows: forward {eager * 1e3:.3f} ms eager vs {replay * 1e3:.3f} ms replayed "
              f"({graphs['forward_time_removed']:.1%} of it removed); step mode with graphs reaches "
              f"{graphs['step_graphs_vs_ceiling']:.1%} of the eager ceiling")
    flops = None
    if ceilings:  # model FLOPs utilisation of the step arm and of the ceiling
        c = sorted(ceilings, key=lambda c: c["ratio"])[len(ceilings) // 2]
        per_image_step = forward_flops(runner, c["rows"], args.steps, size, args.num_frames) / (c["rows"] / cfg_rows)
        peak = args.peak_tflops or known_peak_tflops(config.torch_device, config.torch_dtype)
        achieved = {"step": median_run(runs["step"]).throughput * args.steps * per_image_step / 1e12,
                    "ceiling": c["ceiling"] * args.steps * per_image_step / 1e12}
        flops = {"model_gflops_per_image_step": per_image_step / 1e9, "achieved_tflops": achieved,
                 "peak_tflops": peak, "mfu": {k: v / peak for k, v in achieved.items()} if peak else None}
        mfu = (f" = {flops['mfu']['step']:.1%} MFU (ceiling {flops['mfu']['ceiling']:.1%}; peak {peak:g} TFLOP/s)"
               if peak else " (no peak known for this device: --peak-tflops gives MFU)")
        print(f"model FLOPs (FlopCounterMode): {per_image_step / 1e9:.2f} GFLOP per image per step; step mode "
              f"{achieved['step']:.3f} TFLOP/s, ceiling {achieved['ceiling']:.3f} TFLOP/s{mfu}")
    if args.json:
        print(json.dumps({
            "images_per_s": {k: median_run(v).throughput for k, v in runs.items()},
            "images_per_s_range": {k: [min(x.throughput for x in v), max(x.throughput for x in v)]
                                   for k, v in runs.items()},
            "step_vs_ceiling": step_vs_ceiling,
            "step_vs_ceiling_range": ratio_range,
            "step_vs_in_situ_forwards": in_situ_ratio,
            "step_vs_in_situ_forwards_range": in_situ_range,
            "overhead_batch1": overhead,
            "overhead_batch1_range": overhead_range,
            "overhead_batch1_between_forwards": gap_overhead,
            "overhead_batch1_between_forwards_range": gap_range,
            "flops": flops,
            "cuda_graphs": graphs,
            "model": config.model_path.name, "device": str(config.torch_device), "threads": torch.get_num_threads(),
            "concurrency": concurrency, "request_rate": args.request_rate, "steps": args.steps,
            "context_folding": bool(getattr(runner.adapter, "context_folding", False)),
            "repeats": args.repeats,
        }))


if __name__ == "__main__":
    main()
