"""LoRA serving benchmark: 16 concurrent requests spread over 1, 4 and 16 distinct LoRA adapters.

Arms (one process, the same requests, arms interleaved inside each repeat, median of
``--repeats`` with the range):
  none        the same 16 requests without adapters, same engine (adapters loaded, hooks in place);
  none_clean  the same, on an engine that never loaded an adapter (no hooks at all): the cost of
              LoRA machinery on a batch without LoRA rows is none / none_clean;
  none_split  the no-adapter requests split into as many batches as `split` makes at the largest
              adapter count: the most batching can gain here (mixed / split cannot exceed
              none / none_split by more than LoRA's own cost);
  mixed       diffserve: all 16 requests in the same step batches, each row adding its own
              adapter's low-rank deltas (one denoiser forward per step for all of them);
  split       step batches split by adapter (what vLLM-Omni does: requests with different
              adapters never share a forward): each adapter's requests run as their own batch;
  diffusers   diffusers' pipeline with every adapter loaded, ``set_adapters`` before each
              request, one request at a time (its own ``__call__``, on the same weights).

Throughput is images/s (16 images / time of the arm: wall seconds, or with ``--clock process``
this process's CPU seconds, which other processes on a shared machine barely change). The model is an SD3-architecture
folder with random weights (``--layers``, ``--heads`` of 64 channels, ``--size`` pixels;
benchmark-sized for a CPU) or any SD3 folder given with ``--model``; adapters are random rank
``--rank`` LoRAs on every attention and feed-forward linear layer of the transformer, saved with
diffusers' ``save_lora_weights``.

Usage:
    python benchmarks/lora.py                                   # CPU defaults, 3 repeats
    python benchmarks/lora.py --clock process                   # CPU seconds: a shared, loaded machine
    python benchmarks/lora.py --layers 8 --heads 12 --size 256 --rank 16 --device cuda --threads 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from diffserve import DiffusionEngine, EngineConfig, SamplingParams

TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
#: the clock arms are timed with (``--clock``): wall seconds, or this process's CPU seconds
#: (``time.process_time``: all its threads), which other processes on a shared machine barely move
CLOCK = time.perf_counter

PROMPTS = ["a red apple on a table", "a mountain lake at dawn", "a portrait of an old sailor", "a city at night",
           "a bowl of ramen", "a cat on a windowsill", "a field of sunflowers", "a vintage car in the rain"]


def build_folder(out: Path, layers: int, heads: int, size: int, text_tokens: int) -> Path:
    """An SD3-architecture folder (2 CLIP encoders of `text_tokens` positions, no T5, 16-channel
    8x VAE) with seeded random weights: `layers` joint blocks of `heads` x 64 channels, default
    resolution `size` pixels."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from diffserve.models.digits.tokenizer import build_clip_tokenizer

    torch.manual_seed(0)
    width = heads * 64
    transformer = SD3Transformer2DModel(sample_size=size // 8, patch_size=2, in_channels=16, num_layers=layers,
                                        attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=256,
                                        caption_projection_dim=width, pooled_projection_dim=256, out_channels=16,
                                        pos_embed_max_size=max(size // 16, 16))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(16, 16, 32, 32),
                        layers_per_block=1, latent_channels=16, norm_num_groups=8, sample_size=size)
    encoders = []
    for _ in range(2):
        tok = build_clip_tokenizer(text_tokens)
        config = CLIPTextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                projection_dim=128, vocab_size=len(tok), max_position_embeddings=text_tokens,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
        encoders.append((CLIPTextModelWithProjection(config), tok))
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
                                    vae=vae, text_encoder=encoders[0][0], tokenizer=encoders[0][1],
                                    text_encoder_2=encoders[1][0], tokenizer_2=encoders[1][1], text_encoder_3=None,
                                    tokenizer_3=None)
    pipe.save_pretrained(out)
    return out


def build_adapters(folder: Path, out: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` random rank-`rank` LoRAs (alpha = rank) on the transformer's linear layers of
    `TARGETS`, saved with diffusers' ``save_lora_weights``."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    transformer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    files = {}
    for i in range(count):
        g = torch.Generator().manual_seed(100 + i)
        state = {}
        for path, module in transformer.named_modules():
            if path.endswith(TARGETS) and isinstance(module, torch.nn.Linear):
                state[f"{path}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) / module.in_features ** 0.5
                state[f"{path}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.05
        config = {"r": rank, "lora_alpha": rank, "target_modules": sorted({k.split(".lora_")[0] for k in state})}
        StableDiffusion3Pipeline.save_lora_weights(str(out / f"lora{i}"), transformer_lora_layers=state,
                                                   transformer_lora_adapter_metadata=config)
        files[f"lora{i}"] = out / f"lora{i}"
    return files


def requests(args, adapters: int | None) -> list[tuple[str, SamplingParams]]:
    """The workload: `args.requests` requests, request i with adapter ``lora{i % adapters}``."""
    return [(PROMPTS[i % len(PROMPTS)],
             SamplingParams(seed=i, num_inference_steps=args.steps, guidance_scale=4.0, height=args.size,
                            width=args.size, output_type="latent",
                            loras={f"lora{i % adapters}": 1.0} if adapters else None))
            for i in range(args.requests)]


def run_engine(engine: DiffusionEngine, work: list[tuple[str, SamplingParams]], split: bool) -> float:
    """Wall seconds to serve `work` on `engine`; `split`: each adapter's requests as their own
    batch (in turn), else all at once."""
    groups: dict[tuple, list] = {}
    for prompt, params in work:
        groups.setdefault(tuple(sorted((params.loras or {}).items())) if split else (), []).append((prompt, params))
    start = CLOCK()
    for group in groups.values():
        outs = engine.generate([p for p, _ in group], [q for _, q in group])
        assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
    return CLOCK() - start


def run_engine_groups(engine: DiffusionEngine, work: list[tuple[str, SamplingParams]], groups: list[int]) -> float:
    """Wall seconds to serve `work` in batches of its `groups` (in turn)."""
    start = CLOCK()
    for g in sorted(set(groups)):
        members = [w for w, k in zip(work, groups) if k == g]
        outs = engine.generate([p for p, _ in members], [q for _, q in members])
        assert all(o.ok for o in outs)
    return CLOCK() - start


def run_diffusers(pipe, work: list[tuple[str, SamplingParams]]) -> float:
    """Wall seconds for diffusers: ``set_adapters`` then one ``__call__`` per request."""
    start = CLOCK()
    for prompt, params in work:
        (name, scale), = params.loras.items()
        pipe.set_adapters([name], [scale])
        pipe(prompt, num_inference_steps=params.num_inference_steps, guidance_scale=params.guidance_scale,
             height=params.height, width=params.width, generator=torch.Generator().manual_seed(params.seed),
             output_type="latent")
    return CLOCK() - start


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="an SD3 folder (default: build one, see --layers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6, help="attention heads of 64 channels")
    ap.add_argument("--size", type=int, default=128, help="image side, pixels")
    ap.add_argument("--text-tokens", type=int, default=16, help="CLIP positions (the prompt's tokens per row)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--adapters", default="1,4,16", help="distinct adapters per workload, comma-separated")
    ap.add_argument("--arms", default="none,none_clean,none_split,mixed,split,diffusers")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("wall", "process"), default="wall",
                    help="time arms in wall seconds, or in this process's CPU seconds (all threads; robust to "
                         "other processes on a shared machine; with --threads 1 the two agree on an idle one)")
    ap.add_argument("--json", action="store_true", help="print a final machine-readable JSON line")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.adapters.split(",")]
    arms = args.arms.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="diffserve-lora-bench-"))
    folder = args.model or build_folder(tmp / "model", args.layers, args.heads, args.size, args.text_tokens)
    files = build_adapters(folder, tmp / "loras", max(counts), args.rank)
    base = dict(model=str(folder), device=args.device, max_batch_size=2 * args.requests, num_threads=args.threads or None,
                max_loras=max(counts), max_lora_rank=args.rank)
    engine = DiffusionEngine(EngineConfig(**base, loras={k: str(v) for k, v in files.items()}))
    clean = DiffusionEngine(EngineConfig(**base)) if "none_clean" in arms else None
    pipe = None
    if "diffusers" in arms:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None).to(args.device)
        pipe.set_progress_bar_config(disable=True)
        for name, path in files.items():
            pipe.load_lora_weights(str(path), adapter_name=name)
    # warm-up: every adapter resident, every path run once
    run_engine(engine, requests(args, max(counts)), split=False)
    run_engine(engine, requests(args, None), split=False)
    if clean is not None:
        run_engine(clean, requests(args, None), split=False)

    seconds: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        plan = [("none", None), ("none_clean", None), ("none_split", max(counts))] + [
            (f"{arm}@{k}", k) for k in counts for arm in ("mixed", "split", "diffusers")]
        if repeat % 2:
            plan.reverse()  # interleaved, alternating order: drift favours no arm
        for name, k in plan:
            arm = name.split("@")[0]
            if arm not in arms:
                continue
            if arm == "none":
                s = run_engine(engine, requests(args, None), split=False)
            elif arm == "none_clean":
                s = run_engine(clean, requests(args, None), split=False)
            elif arm == "none_split":  # the adapters' grouping, without adapters
                work = [(p, dataclasses.replace(q, loras=None)) for p, q in requests(args, k)]
                s = run_engine_groups(engine, work, [i % k for i in range(len(work))])
            elif arm == "diffusers":
                s = run_diffusers(pipe, requests(args, k))
            else:
                s = run_engine(engine, requests(args, k), split=arm == "split")
            seconds.setdefault(name, []).append(s)
            print(f"repeat {repeat}  {name:14s} {args.requests / s:7.3f} images/s")

    def rate(name: str) -> float:
        return statistics.median(args.requests / s for s in seconds[name])

    def spread(name: str) -> str:
        rates = [args.requests / s for s in seconds[name]]
        return f"{min(rates):.3f}-{max(rates):.3f}"

    print(f"\nmodel: SD3 architecture, {args.layers} layers x {args.heads * 64} channels, {args.size}px, "
          f"{args.text_tokens} text tokens, "
          f"{args.steps} steps, CFG; LoRA rank {args.rank} on {len(TARGETS)} linears per block; "
          f"{args.requests} requests; device {args.device}, threads {args.threads or torch.get_num_threads()}; "
          f"median of {args.repeats} [min-max], images per {args.clock} second")
    result = {"args": vars(args) | {"model": str(args.model) if args.model else None}, "images_per_s": {}}
    for name in seconds:
        result["images_per_s"][name] = rate(name)
        print(f"  {name:14s} {rate(name):7.3f} [{spread(name)}]")
    if "none" in seconds and "none_split" in seconds:
        print(f"  batching without LoRA: none / none_split ({max(counts)} batches) = "
              f"{rate('none') / rate('none_split'):.2f}x")
    if "none" in seconds and "none_clean" in seconds:
        print(f"  LoRA machinery on a batch without LoRA rows: none / none_clean = "
              f"{rate('none') / rate('none_clean'):.3f}")
    for k in counts:
        line = [f"  {k:2d} adapters:"]
        if f"mixed@{k}" in seconds and "none" in seconds:
            line.append(f"mixed / none = {rate(f'mixed@{k}') / rate('none'):.3f}")
        if f"mixed@{k}" in seconds and f"split@{k}" in seconds:
            line.append(f"mixed / split = {rate(f'mixed@{k}') / rate(f'split@{k}'):.2f}x")
        if f"mixed@{k}" in seconds and f"diffusers@{k}" in seconds:
            line.append(f"mixed / diffusers = {rate(f'mixed@{k}') / rate(f'diffusers@{k}'):.2f}x")
        print("  ".join(line))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
