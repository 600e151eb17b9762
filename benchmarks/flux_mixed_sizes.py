"""One Flux transformer forward over rows of different sizes (`diffserve.pipelines.flux.mixed_sizes`)
vs the alternatives, on the same rows, interleaved per repeat:

- ``grouped``: one forward, each row's packed tokens right-padded to the longest between blocks,
  every block run once per row size on real tokens only (`diffserve.pipelines.length_groups`:
  what diffserve runs in eager forwards);
- ``mixed``: one forward, each row's packed tokens right-padded to the longest, per-row RoPE
  tables and padded keys masked in every block (``--no-length-groups``, and compiled blocks);
- ``uniform``: one forward of the same number of rows, all at the largest size, stock
  processors (the padded shape's floor: ``mixed / uniform`` is what per-row RoPE + masks cost);
- ``per_size``: one stock forward per size (what batching by size runs for these rows).

A random-weight `FluxTransformer2DModel` (no download): ``--layers``/``--single-layers`` blocks of
width ``--heads`` x ``--head-dim`` (FLUX.1's rotary split of the head dim, scaled), or the
``transformer`` of a Flux folder (``--model DIR``).

Usage::

    python benchmarks/flux_mixed_sizes.py                       # built-in mix, 1 thread
    python benchmarks/flux_mixed_sizes.py --mix 1024x1024:2,512x1024:2,512x512:4 --device cuda --dtype bf16

Prints, per arm, the median and [min, max] ms per forward and the ratios (median of the
per-repeat ratios) of ``grouped`` and of ``mixed`` to the other arms.
"""

from __future__ import annotations

import argparse

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from diffserve.pipelines.flux.mixed_sizes import FluxSpans, install_token_spans
from diffserve.pipelines.row_data import RowData, forward_rows
from diffserve.pipelines.token_spans import IMAGE_TOKENS, LATENT_SIZE
from interleaved_arms import add_timing_arguments, device_sync, print_summary, summarize, time_arms  # benchmarks/interleaved_arms.py (same folder)

VAE_FACTOR = 8


def parse_mix(text: str) -> list[tuple[int, int]]:
    """``"256x256:2,128x256:3"`` -> [(height, width)] per row (``HxW:count``, pixels)."""
    rows = []
    for part in text.split(","):
        size, _, count = part.partition(":")
        h, w = (int(x) for x in size.lower().split("x"))
        rows += [(h, w)] * int(count or 1)
    return rows


#: whether the blocks run per row size (read by the grouped block forwards per call)
GROUPED = {"on": True}


def build(args) -> FluxTransformer2DModel:
    if args.model:
        model = FluxTransformer2DModel.from_pretrained(args.model, subfolder="transformer")
    else:
        torch.manual_seed(0)
        side = args.head_dim * 7 // 16 // 2 * 2  # FLUX.1: (16, 56, 56) of 128; every part even
        rope = [args.head_dim - 2 * side, side, side]
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=args.layers,
                                       num_single_layers=args.single_layers, attention_head_dim=args.head_dim,
                                       num_attention_heads=args.heads, joint_attention_dim=args.text_dim,
                                       pooled_projection_dim=args.text_dim, guidance_embeds=True, axes_dims_rope=rope)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = model.to(args.device, dtype).eval()
    install_token_spans(model, grouped=lambda: GROUPED["on"])
    return model


def inputs(model, sizes: list[tuple[int, int]], text: int, device, dtype, pad_to: int | None = None) -> dict:
    """Forward kwargs of rows `sizes` (pixels): packed latents right-padded to the longest."""
    g = torch.Generator().manual_seed(0)
    grids = [(h // VAE_FACTOR // 2, w // VAE_FACTOR // 2) for h, w in sizes]
    longest = pad_to or max(gh * gw for gh, gw in grids)
    cfg = model.config
    hidden = torch.zeros(len(sizes), longest, cfg.in_channels)
    for r, (gh, gw) in enumerate(grids):
        hidden[r, : gh * gw] = torch.randn(gh * gw, cfg.in_channels, generator=g)
    first = grids[0]
    ids = FluxPipeline._prepare_latent_image_ids(None, *first, "cpu", dtype)
    ids = torch.cat([ids, ids.new_zeros(longest - ids.shape[0], 3)])
    n = len(sizes)
    return dict(hidden_states=hidden.to(device, dtype),
                encoder_hidden_states=torch.randn(n, text, cfg.joint_attention_dim, generator=g).to(device, dtype),
                pooled_projections=torch.randn(n, cfg.pooled_projection_dim, generator=g).to(device, dtype),
                timestep=torch.rand(n, generator=g).to(device, dtype), guidance=torch.full((n,), 3.5, device=device),
                img_ids=ids.to(device), txt_ids=torch.zeros(text, 3, device=device, dtype=dtype))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", default="256x256:2,128x256:2,256x128:1,128x128:1", help="HxW:rows,... in pixels")
    ap.add_argument("--model", default=None, help="a Flux folder (its transformer); default: random weights")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--single-layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--text-dim", type=int, default=256)
    ap.add_argument("--text", type=int, default=64, help="text tokens (max_sequence_length)")
    add_timing_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args)
    dtype = next(model.parameters()).dtype
    sizes = parse_mix(args.mix)
    latent = [(h // VAE_FACTOR // 2 * 2, w // VAE_FACTOR // 2 * 2) for h, w in sizes]
    rows = RowData({LATENT_SIZE: tuple(latent), IMAGE_TOKENS: tuple((h // 2) * (w // 2) for h, w in latent)},
                   len(sizes))
    mixed_kw = inputs(model, sizes, args.text, args.device, dtype)
    spans = FluxSpans(args.text, mixed_kw["hidden_states"].shape[1], dtype)
    largest = max(sizes, key=lambda s: s[0] * s[1])
    uniform_kw = inputs(model, [largest] * len(sizes), args.text, args.device, dtype)
    groups = [inputs(model, [s] * sizes.count(s), args.text, args.device, dtype) for s in dict.fromkeys(sizes)]

    sync = device_sync(args.device)

    @torch.inference_mode()
    def arm(name: str) -> None:
        if name in ("grouped", "mixed"):
            GROUPED["on"] = name == "grouped"
            with forward_rows(rows):
                model(**mixed_kw, joint_attention_kwargs={"spans": spans})
        elif name == "uniform":
            model(**uniform_kw)
        else:
            for kw in groups:
                model(**kw)

    # the warm-up call of each arm also builds the per-row tables, built once per batch composition
    times = time_arms(arm, ["grouped", "mixed", "uniform", "per_size"], args.repeats, args.iters, sync)
    result, ratios = summarize(times, "grouped")
    ratios.update({k: v for k, v in summarize(times, "mixed")[1].items() if k != "mixed/grouped"})
    tokens = {"real": sum(rows[IMAGE_TOKENS]), "padded": spans.longest * len(sizes)}
    header = (f"rows {len(sizes)} ({args.mix}); image tokens real {tokens['real']}, padded {tokens['padded']}; "
              f"text {args.text}; {args.device} {args.dtype}, {args.threads} thread(s)")
    print_summary(result, ratios, header, {"tokens": tokens}, args.json)


if __name__ == "__main__":
    main()
