"""One Qwen-Image transformer forward over rows of different sizes
(`diffserve.pipelines.qwen_image.mixed_sizes`), length groups vs the padded masked forward, on
the same rows, interleaved per repeat:

- ``grouped``: one forward, each row's packed tokens right-padded to the longest between blocks,
  every block run once per (row size, text length) on real tokens only, no mask
  (`diffserve.pipelines.length_groups`: what diffserve runs in eager forwards);
- ``mixed``: one forward, every block over the padded rows with per-row RoPE tables and padded
  image and text keys masked (``--no-length-groups``, and compiled blocks);
- ``per_size``: one stock forward per (size, text length) (what batching by size runs).

A random-weight `QwenImageTransformer2DModel` (no download): ``--layers`` blocks of width
``--heads`` x ``--head-dim`` (Qwen-Image's rotary split of the head dim, scaled).

Usage::

    python benchmarks/qwen_mixed_sizes.py                            # built-in mix, one text length
    python benchmarks/qwen_mixed_sizes.py --texts 64,40               # rows' texts alternate 64, 40 tokens

Prints, per arm, the median and [min, max] ms per forward and ``grouped``'s ratios (median of
the per-repeat ratios) to the other arms.
"""

from __future__ import annotations

import argparse

import torch
from diffusers import QwenImageTransformer2DModel

from diffserve.pipelines.qwen_image.mixed_sizes import PATCH, QwenSpans, install_token_spans
from diffserve.pipelines.row_data import RowData, forward_rows
from diffserve.pipelines.token_spans import IMAGE_TOKENS, LATENT_SIZE
from flux_mixed_sizes import parse_mix  # benchmarks/flux_mixed_sizes.py (same folder)
from interleaved_arms import add_timing_arguments, device_sync, print_summary, summarize, time_arms  # benchmarks/interleaved_arms.py (same folder)

VAE_FACTOR = 8

#: whether the blocks run per row size (read by the grouped block forwards per call)
GROUPED = {"on": True}


def build(args) -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    side = args.head_dim * 7 // 16 // 2 * 2  # Qwen-Image: (16, 56, 56) of 128; every part even
    model = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=args.layers,
                                        attention_head_dim=args.head_dim, num_attention_heads=args.heads,
                                        joint_attention_dim=args.text_dim,
                                        axes_dims_rope=(args.head_dim - 2 * side, side, side))
    model = model.to(args.device, {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]).eval()
    install_token_spans(model, grouped=lambda: GROUPED["on"])
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", default="256x256:2,128x256:2,256x128:1,128x128:1", help="HxW:rows,... in pixels")
    ap.add_argument("--texts", default="64", help="text tokens, cycled over the rows (e.g. 64,40)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--text-dim", type=int, default=256)
    add_timing_arguments(ap, dtypes=("fp32", "bf16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args)
    dtype, device = next(model.parameters()).dtype, torch.device(args.device)
    sizes = parse_mix(args.mix)
    lengths = [int(x) for x in args.texts.split(",")]
    texts = [lengths[r % len(lengths)] for r in range(len(sizes))]
    grids = [(h // VAE_FACTOR // PATCH, w // VAE_FACTOR // PATCH) for h, w in sizes]
    tokens = [gh * gw for gh, gw in grids]
    longest, text = max(tokens), max(texts)
    g = torch.Generator().manual_seed(0)
    real = [torch.randn(n, 64, generator=g) for n in tokens]
    ctx = [torch.randn(t, args.text_dim, generator=g) for t in texts]
    hidden, context = torch.zeros(len(sizes), longest, 64), torch.zeros(len(sizes), text, args.text_dim)
    mask = torch.zeros(len(sizes), text, dtype=torch.bool)
    for r, (n, t) in enumerate(zip(tokens, texts)):
        hidden[r, :n], context[r, :t], mask[r, :t] = real[r], ctx[r], True
    timestep = torch.rand(len(sizes), generator=g)
    rows = RowData({LATENT_SIZE: tuple((PATCH * gh, PATCH * gw) for gh, gw in grids), IMAGE_TOKENS: tuple(tokens)},
                   len(sizes))
    mixed_kw = dict(hidden_states=hidden.to(device, dtype), encoder_hidden_states=context.to(device, dtype),
                    encoder_hidden_states_mask=None if len(set(texts)) == 1 else mask.to(device),
                    timestep=timestep.to(device, dtype), img_shapes=[[(1, *grids[0])]] * len(sizes),
                    attention_kwargs={"spans": QwenSpans(longest)})
    per_size = []
    for key in dict.fromkeys(zip(grids, texts)):
        members = [r for r, k in enumerate(zip(grids, texts)) if k == key]
        per_size.append(dict(hidden_states=torch.stack([real[r] for r in members]).to(device, dtype),
                             encoder_hidden_states=torch.stack([ctx[r] for r in members]).to(device, dtype),
                             timestep=timestep[members].to(device, dtype),
                             img_shapes=[[(1, *key[0])]] * len(members)))

    sync = device_sync(args.device)

    @torch.inference_mode()
    def arm(name: str) -> None:
        if name in ("grouped", "mixed"):
            GROUPED["on"] = name == "grouped"
            with forward_rows(rows):
                model(**mixed_kw)
        else:
            for kw in per_size:
                model(**kw)

    # the warm-up call of each arm also builds the per-row tables, built once per batch composition
    times = time_arms(arm, ["grouped", "mixed", "per_size"], args.repeats, args.iters, sync)
    result, ratios = summarize(times, "grouped")
    counts = {"real": sum(tokens), "padded": longest * len(sizes)}
    header = (f"rows {len(sizes)} ({args.mix}); image tokens real {counts['real']}, padded {counts['padded']}; "
              f"texts {texts}; {args.device} {args.dtype}, {args.threads} thread(s)")
    print_summary(result, ratios, header, {"tokens": counts}, args.json)


if __name__ == "__main__":
    main()
