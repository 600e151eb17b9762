"""SLO attainment of the scheduling policies in virtual time: the real request scheduler
(`diffserve.engine.queues.RequestQueues`) on a simulated clock (issue 27).

Why: `benchmarks/serving.py --trace builtin --slo-scales ...` measures the policies on the real
engine, but "100% load" there is a fraction of a capacity probe whose speed depends on how busy
the (shared) machine is at that moment, so repeats swing by 50-90 points. Here every duration
comes from a step cost model, so a run is exact and repeatable and "100% load" is exact.

What runs: the trace benchmark's built-in mix (`serving.builtin_trace`: sizes 40% full / 25%
half height / 20% half width / 15% quarter area, 60% `--steps` and 40% half, 30% interactive
priority 0 and 70% batch priority 1) with Poisson arrivals (`serving._at_rate`) at each of
`--loads` x the capacity. A discrete-event loop feeds real `Request` objects (rows, tokens and
batch keys as the built-in model's engine makes them: per-size arms key by (height, width),
mixed arms by nothing) to a real `RequestQueues` whose clock is the simulation's: at each step
boundary it adds the requests that arrived, calls `admit` and `select_batch` (admitted requests
denoise at once: encoding and decoding take no time here), advances the clock by the step's
cost ``a + b x token slots`` (`RequestQueues.batch_slots`: rows x the widest row's tokens, what
a padded mixed forward computes; with ``--padding-free``, ``a + b x real tokens``: what a forward
run per length group computes), feeds that duration to the queues' online cost model (as the
engine does) and finishes requests whose steps are done. ``--admission slo`` refuses at arrival
with the engine's own prediction (`RequestQueues.predict_latency`); a refusal is a miss.

Capacity: the per-size FCFS arm's closed-loop throughput at `--concurrency` on the same trace in
the same simulation (per trace seed; `--capacity-arm mixed`: mixed-size FCFS's, a higher load at
which the policies have more requests than rows to choose from). Deadlines: scale x each request's solo latency (the same
loop with the request alone), for each of `--scales`. Reported per load, scale and arm over
`--seeds` trace seeds: SLO attainment (%, median [min, max]), goodput (requests within their
deadline per second), preemptions and the longest queue wait; plus each arm's points over the
first of `--arms` (default `per_size`), paired by seed.

Cost model: ``--cost a,b`` (seconds, seconds per token slot), or measured by a short real run in
the same command: the built-in model's engine replays the trace closed loop (per-size and mixed
batching), and its scheduler's step cost model, switched to no forgetting (ordinary least
squares over every step), gives (a, b).

Not modelled: the host's variance (every step costs exactly its prediction), encode and decode
(zero time, so they neither hold rows nor delay a request), the engine's tick overhead and the
gap between an arrival and the next step boundary's admission (zero).

Arms: ``per_size`` / ``mixed`` (batching of sizes), then optionally ``_priority`` or ``_slo``
(policy; default FCFS), ``_adm`` (``--admission slo``), ``_padR`` (padding cap R, or ``auto``),
e.g. ``mixed_slo_adm``, ``mixed_pad0.25``.

Usage:
    python benchmarks/slo_simulation.py                      # measure (a, b), then simulate
    python benchmarks/slo_simulation.py --cost 0.004,7.4e-5 --seeds 10 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
from types import SimpleNamespace

from diffserve.core.sampling_params import SamplingParams
from diffserve.engine.cost_model import StepCostModel
from diffserve.engine.queues import RequestQueues
from diffserve.engine.request import Phase, Request
from serving import TraceJob, _at_rate, builtin_trace  # benchmarks/serving.py (same folder)

#: the built-in `digits` model: 8x8 px, resolution factor 2, 2 rows a request (CFG), 16 rows a step
BUILTIN = SimpleNamespace(default_height=8, default_width=8, resolution_factor=2)
ROWS = 2


@dataclasses.dataclass(frozen=True)
class Arm:
    """A simulated engine configuration (see the module docstring's arm names)."""

    mixed: bool
    policy: str = "fcfs"
    admission: str = "all"
    max_padding_ratio: float | str = 1.0


def parse_arm(name: str) -> Arm:
    """`Arm` of an arm name such as ``mixed_slo_adm`` or ``per_size_pad0.5``.

    Raises:
        ValueError: an unknown part (naming the allowed ones).
    """
    match = re.fullmatch(r"(per_size|mixed)(_priority|_slo)?(_adm)?(_pad(?:auto|[0-9.]+))?", name)
    if not match:
        raise ValueError(f"arm {name!r}: expected per_size|mixed, then optionally _priority|_slo, _adm, "
                         "_padR (R in [0, 1] or auto)")
    batching, policy, adm, pad = match.groups()
    ratio: float | str = 1.0
    if pad:
        ratio = pad[4:] if pad[4:] == "auto" else float(pad[4:])
    return Arm(mixed=batching == "mixed", policy=policy[1:] if policy else "fcfs",
               admission="slo" if adm else "all", max_padding_ratio=ratio)


@dataclasses.dataclass
class Outcome:
    """One request's fate in a simulation (virtual seconds; finish None = refused)."""

    job: TraceJob
    arrival: float
    admitted: float | None = None
    finish: float | None = None

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival


def simulate(jobs: list[TraceJob], arm: Arm, cost: tuple[float, float], max_batch_size: int = 16,
             concurrency: int | None = None, aging_s: float = 60.0, factor: int = 2,
             rows: int = ROWS, padding_free: bool = False) -> tuple[list[Outcome], RequestQueues]:
    """Run `jobs` through a real `RequestQueues` in virtual time (the module docstring).

    Args:
        jobs: the trace (`arrival_s` in seconds; ignored in a closed loop).
        arm: batching, policy, admission and padding cap.
        cost: (a seconds, b seconds per token slot) of a denoising step.
        concurrency: closed loop with this many requests outstanding (None: open loop at the
            jobs' arrivals).
        factor: pixels per latent token side (tokens of a row: height / factor x width / factor).
        rows: denoiser rows per request.
        padding_free: a step costs its real tokens instead of its token slots (length groups:
            `RequestQueues.cost_tokens`), and the queues know it (``auto`` padding, cost model).

    Returns:
        (one `Outcome` per job, in job order; the queues, for `preemptions`).
    """
    a, b = cost
    now = [0.0]
    queues = RequestQueues(max_batch_size, max_waiting=len(jobs) + 1, policy=arm.policy, aging_s=aging_s,
                           cost_model=StepCostModel(), max_padding_ratio=arm.max_padding_ratio,
                           clock=lambda: now[0], padding_free=padding_free)
    outcomes: list[Outcome | None] = [None] * len(jobs)
    requests: dict[int, Request] = {}
    next_job = done = 0

    def arrive(i: int, at: float) -> None:
        nonlocal done
        job = jobs[i]
        outcomes[i] = Outcome(job, at)
        tokens = rows * max(job.height // factor, 1) * max(job.width // factor, 1)
        params = SamplingParams(num_inference_steps=job.steps, height=job.height, width=job.width,
                                priority=job.priority, deadline_s=job.deadline_s)
        request = Request(request_id=str(i), prompt=job.prompt, params=params,
                          batch_key=None if arm.mixed else (job.height, job.width), rows=rows, seq=i,
                          arrival_time=at, num_steps=job.steps, tokens=tokens)
        if arm.admission == "slo" and job.deadline_s is not None:
            prediction = queues.predict_latency(request)
            if prediction is not None and prediction[0] > job.deadline_s:
                done += 1  # refused at arrival: a miss
                return
        requests[id(request)] = request
        queues.add(request)

    while done < len(jobs):
        while next_job < len(jobs):  # arrivals up to this step boundary
            if concurrency:
                if next_job - done >= concurrency:
                    break
                arrive(next_job, now[0])
            elif jobs[next_job].arrival_s <= now[0]:
                arrive(next_job, jobs[next_job].arrival_s)
            else:
                break
            next_job += 1
        for request in queues.admit():
            request.phase = Phase.DENOISING  # encoding takes no time here
            outcomes[request.seq].admitted = now[0]
        batch = list(queues.select_batch())
        if not batch:
            if next_job < len(jobs) and not concurrency:  # idle: jump to the next arrival
                now[0] = max(now[0], jobs[next_job].arrival_s)
                continue
            if done < len(jobs) and (queues.running or queues.waiting):
                raise RuntimeError(f"simulation stalled at {now[0]:.3f} s: requests held but no batch")
            continue
        seconds = a + b * queues.cost_tokens
        queues.cost_model.observe(queues.cost_tokens, seconds)  # as the engine's scheduler does
        now[0] += seconds
        for request in batch:
            request.steps_done += 1
            if request.steps_done >= request.num_steps:
                request.phase = Phase.DONE
                queues.finish(request)
                outcomes[request.seq].finish = now[0]
                done += 1
    return outcomes, queues


def solo_latencies(jobs: list[TraceJob], cost: tuple[float, float], **kwargs) -> dict[tuple[int, int, int], float]:
    """Virtual seconds of each (height, width, steps) of `jobs` run alone (per-size FCFS)."""
    solo = {}
    for job in jobs:
        key = (job.height, job.width, job.steps)
        if key not in solo:
            alone, _ = simulate([dataclasses.replace(job, arrival_s=0.0, deadline_s=None)], parse_arm("per_size"),
                                cost, **kwargs)
            solo[key] = alone[0].latency
    return solo


def capacity(jobs: list[TraceJob], cost: tuple[float, float], concurrency: int, arm: str = "per_size",
             **kwargs) -> float:
    """Requests per virtual second of `arm` (default per-size FCFS), closed loop at `concurrency`."""
    outcomes, _ = simulate(jobs, parse_arm(arm), cost, concurrency=concurrency, **kwargs)
    return len(outcomes) / max(o.finish for o in outcomes)


def score(outcomes: list[Outcome], queues: RequestQueues) -> dict:
    """Attainment (met / all requests, refusals as misses), goodput (met per second from the
    first arrival to the last finish), preemptions, longest queue wait, refusals."""
    met = sum(o.latency is not None and o.latency <= o.job.deadline_s for o in outcomes)
    finished = [o for o in outcomes if o.finish is not None]
    span = max(o.finish for o in finished) - min(o.arrival for o in outcomes) if finished else float("inf")
    return {"attainment": met / len(outcomes), "goodput": met / span, "preemptions": queues.preemptions,
            "max_wait_s": max((o.admitted - o.arrival for o in finished), default=0.0),
            "refused": len(outcomes) - len(finished)}


def sweep(args, cost: tuple[float, float]) -> list[dict]:
    """One row per (load, scale, arm, seed): `score` plus the capacity."""
    arms = [parse_arm(a) for a in args.arms]
    common = {"max_batch_size": args.max_batch_size, "aging_s": args.aging_s, "padding_free": args.padding_free}
    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        trace_args = SimpleNamespace(seed=seed, size=None, num_requests=args.num_requests, steps=args.steps,
                                     slo_tight=1.0, slo_loose=1.0)
        jobs = builtin_trace(trace_args, BUILTIN, 1.0)
        solo = solo_latencies(jobs, cost, **common)
        jobs = [dataclasses.replace(j, solo_s=solo[(j.height, j.width, j.steps)]) for j in jobs]
        cap = capacity(_at_rate(jobs, None, seed), cost, args.concurrency, args.capacity_arm, **common)
        for load in args.loads:
            timed = _at_rate(jobs, load * cap, seed)
            for scale in args.scales:
                scaled = [dataclasses.replace(j, deadline_s=scale * j.solo_s) for j in timed]
                for name, arm in zip(args.arms, arms):
                    outcomes, queues = simulate(scaled, arm, cost, **common)
                    rows.append({"seed": seed, "load": load, "scale": scale, "arm": name, "capacity": cap,
                                 **score(outcomes, queues)})
    return rows


def _mmm(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def table(rows: list[dict], arms: list[str]) -> str:
    """Two markdown tables, per load and scale: each arm's attainment % and its points over the
    first arm (paired by seed); then goodput (requests/s), preemptions and the longest queue wait
    of each arm. Cells: median [min, max] over the seeds."""
    base = arms[0]
    loads, scales = sorted({r["load"] for r in rows}), sorted({r["scale"] for r in rows})

    def cells(load: float, scale: float) -> dict[str, list[dict]]:
        return {a: sorted((r for r in rows if r["load"] == load and r["scale"] == scale and r["arm"] == a),
                          key=lambda r: r["seed"]) for a in arms}

    def render(head: list[str], lines: list[list[str]]) -> list[str]:
        return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + ["| " + " | ".join(x) + " |" for x in lines]

    first, second = [], []
    for load in loads:
        for scale in scales:
            cell = cells(load, scale)
            key = [f"{load:.0%}", f"{scale:g}"]
            first.append(key + [_mmm([100 * r["attainment"] for r in cell[a]], "{:.0f}") for a in arms]
                         + [_mmm([100 * (r["attainment"] - q["attainment"]) for r, q in zip(cell[a], cell[base])],
                                 "{:+.0f}") for a in arms[1:]])
            second.append(key + [f"{_mmm([r['goodput'] for r in cell[a]], '{:.1f}')}; "
                                 f"{_mmm([r['preemptions'] for r in cell[a]], '{:.0f}')}; "
                                 f"{_mmm([r['max_wait_s'] for r in cell[a]], '{:.2f}')}" for a in arms])
    out = render(["load", "scale"] + arms + [f"{a} - {base}" for a in arms[1:]], first)
    out += ["", "goodput (req/s); preemptions; longest queue wait (s):", ""]
    out += render(["load", "scale"] + arms, second)
    return "\n".join(out)


def measure_cost(args) -> tuple[float, float]:
    """(a, b) of the built-in model on this machine: its engine replays the trace closed loop at
    `--concurrency`, per-size then mixed, with the scheduler's step cost model fitted without
    forgetting (least squares over every step); the tokens the engine gives each request are
    checked against the simulation's."""
    from diffserve import DiffusionEngine, EngineConfig
    from serving import replay

    trace_args = SimpleNamespace(seed=args.seed, size=None, num_requests=args.measure_requests, steps=args.steps,
                                 slo_tight=1.0, slo_loose=1.0)
    jobs = _at_rate(builtin_trace(trace_args, BUILTIN, 1.0), None, args.seed)
    fit = StepCostModel(decay=1.0)
    for mixed in (False, True):
        engine = DiffusionEngine(EngineConfig(mixed_sizes=mixed, max_batch_size=args.max_batch_size))
        try:
            replay(engine, jobs[:4], args.concurrency, None, args.seed)  # warm-up, not fitted
            engine.scheduler.queues.cost_model = fit
            rid = engine.add_request("digit 1", SamplingParams(height=8, width=4, num_inference_steps=1,
                                                               output_type="latent"))
            request = engine.scheduler.requests[rid]
            assert request.rows == ROWS and request.tokens == ROWS * 4 * 2, (request.rows, request.tokens)
            while engine.has_unfinished_requests():
                engine.step()
            replay(engine, jobs, args.concurrency, None, args.seed)
        finally:
            engine.shutdown()
    a, b = fit.coefficients()
    print(f"cost model measured on the built-in model ({fit.steps} steps): a = {a * 1000:.3f} ms, "
          f"b = {b * 1e6:.2f} us per token slot")
    return a, b


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    """An argparse type: a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: must be a positive finite number")
    return value


def _positive_floats(text: str) -> list[float]:
    """An argparse type: comma-separated positive finite numbers (``--loads``, ``--scales``)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected comma-separated positive numbers")
    return [_positive_float(x) for x in items]


def _arm_names(text: str) -> list[str]:
    """An argparse type: comma-separated arm names, each checked by `parse_arm`."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected comma-separated arm names")
    for name in names:
        try:
            parse_arm(name)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return names


def _arm_name(text: str) -> str:
    """An argparse type: one arm name (``--capacity-arm``)."""
    names = _arm_names(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected one arm name")
    return names[0]


def _cost(text: str) -> tuple[float, float]:
    """An argparse type: ``a,b``, two non-negative finite numbers (seconds, seconds per slot)."""
    try:
        cost = tuple(float(x) for x in text.split(","))
    except ValueError:
        cost = ()
    if len(cost) != 2 or not all(math.isfinite(x) and x >= 0 for x in cost):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: expected a,b (two non-negative numbers: seconds, seconds per slot)")
    return cost


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a bad value exits 2 with a usage error naming its flag.

    ``arms`` is a list of arm names, ``capacity_arm`` one, ``loads`` / ``scales`` lists of
    floats, ``cost`` ``(a, b)`` or None (measure it on the built-in model)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cost", type=_cost, help="a,b: step seconds = a + b x token slots (default: measure)")
    parser.add_argument("--arms", type=_arm_names, default="per_size,mixed,mixed_priority,mixed_slo,mixed_slo_adm")
    parser.add_argument("--loads", type=_positive_floats, default="0.8,1.0")
    parser.add_argument("--scales", type=_positive_floats, default="1.5,2,3,5,8")
    parser.add_argument("--seeds", type=_positive_int, default=5, help="trace seeds (from --seed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=_positive_int, default=96)
    parser.add_argument("--steps", type=_positive_int, default=8)
    parser.add_argument("--max-batch-size", type=_positive_int, default=16)
    parser.add_argument("--concurrency", type=_positive_int, default=8, help="closed loop of the capacity run")
    parser.add_argument("--capacity-arm", type=_arm_name, default="per_size",
                        help="the arm whose closed-loop throughput is 100%% load (default per_size: today's)")
    parser.add_argument("--aging-s", type=_positive_float, default=60.0)
    parser.add_argument("--padding-free", action="store_true",
                        help="steps cost their real tokens, not their token slots (length groups)")
    parser.add_argument("--measure-requests", type=_positive_int, default=48,
                        help="requests of each measuring replay")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every row")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    cost = args.cost if args.cost is not None else measure_cost(args)
    rows = sweep(args, cost)
    caps = sorted({r["capacity"] for r in rows})
    print(f"cost a = {cost[0] * 1000:.3f} ms, b = {cost[1] * 1e6:.2f} us/slot; {args.seeds} trace seeds x "
          f"{args.num_requests} requests; {args.capacity_arm} capacity {caps[0]:.1f}-{caps[-1]:.1f} req/s "
          f"(concurrency {args.concurrency}); attainment % median [min, max] over seeds")
    print(table(rows, args.arms))
    if args.json:
        print(json.dumps({"cost": cost, "rows": rows}))


if __name__ == "__main__":
    main()
