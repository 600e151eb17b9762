"""The generation metadata an output carries: what the CLI's files and the server's stored
videos record about the request that made them.

Fields (`generation_fields`): prompt, negative_prompt, num_inference_steps, guidance_scale,
seed, width, height, model, and, where the request used them, true_cfg_scale, guidance_scale_2,
strength (edits), num_frames and fps (videos). They travel as:

- PNG: text chunks ``parameters`` (the AUTOMATIC1111 layout, read by A1111, ComfyUI and image
  sites) and ``diffserve`` (JSON);
- MP4: container tags written by the encoder (`video_encoding.encode_mp4`): ``comment`` (the
  same ``parameters`` text) and ``diffserve`` (JSON);
- animated WebP / GIF: a sidecar JSON file next to the file (the JSON; written by the CLI,
  `diffserve.entrypoints.output_files`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffserve.core.sampling_params import SamplingParams


def generation_fields(prompt: str, params: "SamplingParams", seed: int, model: str) -> dict[str, Any]:
    """The JSON metadata of one output (see the module docstring); a guidance the model does
    not use is None."""
    fields: dict[str, Any] = {
        "prompt": prompt,
        "negative_prompt": params.negative_prompt or "",
        "num_inference_steps": params.num_inference_steps,
        "guidance_scale": params.guidance_scale,
        "seed": seed,
        "width": params.width,
        "height": params.height,
        "model": model,
    }
    for name in ("true_cfg_scale", "guidance_scale_2", "strength", "num_frames", "fps", "loras"):
        value = getattr(params, name, None)
        if value is not None:
            fields[name] = value
    return fields


def parameters_text(fields: dict[str, Any]) -> str:
    """`generation_fields` in the AUTOMATIC1111 ``parameters`` layout: the prompt, an optional
    ``Negative prompt:`` line, then ``Steps, CFG scale, Seed, Size, Model`` (plus ``Denoising
    strength`` for edits and ``Frames, FPS`` for videos). LoRA adapters follow the prompt as
    A1111 writes them: ``<lora:NAME:SCALE>``."""
    loras = fields.get("loras") or {}
    lines = [" ".join([fields["prompt"], *(f"<lora:{name}:{scale:g}>" for name, scale in loras.items())])]
    if fields.get("negative_prompt"):
        lines.append(f"Negative prompt: {fields['negative_prompt']}")
    cfg = fields["guidance_scale"] if fields.get("guidance_scale") is not None else fields.get("true_cfg_scale")
    settings = [f"Steps: {fields['num_inference_steps']}"] + ([f"CFG scale: {cfg:g}"] if cfg is not None else [])
    settings += [f"Seed: {fields['seed']}", f"Size: {fields['width']}x{fields['height']}", f"Model: {fields['model']}"]
    if fields.get("strength") is not None:
        settings.append(f"Denoising strength: {fields['strength']:g}")
    if fields.get("num_frames") is not None:
        settings += [f"Frames: {fields['num_frames']}", f"FPS: {fields['fps']}"]
    lines.append(", ".join(settings))
    return "\n".join(lines)


def png_metadata(prompt: str, params: "SamplingParams", seed: int, model: str) -> dict[str, str]:
    """PNG text chunks describing one generated image.

    Returns:
        ``{"parameters": A1111-style text, "diffserve": JSON}``; the JSON holds prompt,
        negative_prompt, num_inference_steps, guidance_scale, seed, width, height (pixels) and
        model, plus true_cfg_scale for models that use it (Qwen-Image, Flux), strength for
        edits and loras ({name: scale}) when the request used LoRA adapters. A guidance the model does not use is null in the JSON and left out of
        ``parameters``.
    """
    fields = generation_fields(prompt, params, seed, model)
    return {"parameters": parameters_text(fields), "diffserve": json.dumps(fields, ensure_ascii=False)}


def video_metadata(prompt: str, params: "SamplingParams", seed: int, model: str) -> dict[str, str]:
    """MP4 container tags describing one generated video: ``comment`` (A1111-style text) and
    ``diffserve`` (JSON, with num_frames and fps)."""
    fields = generation_fields(prompt, params, seed, model)
    return {"comment": parameters_text(fields), "diffserve": json.dumps(fields, ensure_ascii=False)}
