"""Files the CLI writes (``diffserve generate`` / ``diffserve edit``) and the generation metadata
they carry (also in the videos the server stores).

Naming: ``NNNN_seedS.EXT`` in the output folder, numbered after the highest ``NNNN_`` already
there, so names sort in generation order across runs; each file reproduces alone from its seed.
The folder is created only when there is something to write.

Metadata (`generation_fields`): prompt, negative_prompt, num_inference_steps, guidance_scale,
seed, width, height, model, and, where the request used them, true_cfg_scale, guidance_scale_2,
strength (edits), num_frames and fps (videos). It travels as:

- PNG: text chunks ``parameters`` (the AUTOMATIC1111 layout, read by A1111, ComfyUI and image
  sites) and ``diffserve`` (JSON);
- MP4: container tags written by the encoder (`video_encoding.encode_mp4`): ``comment`` (the
  same ``parameters`` text) and ``diffserve`` (JSON);
- animated WebP / GIF: a sidecar ``NNNN_seedS.json`` next to the file (the JSON).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL import Image

    from diffserve.sampling_params import SamplingParams


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
    for name in ("true_cfg_scale", "guidance_scale_2", "strength", "num_frames", "fps"):
        value = getattr(params, name, None)
        if value is not None:
            fields[name] = value
    return fields


def parameters_text(fields: dict[str, Any]) -> str:
    """`generation_fields` in the AUTOMATIC1111 ``parameters`` layout: the prompt, an optional
    ``Negative prompt:`` line, then ``Steps, CFG scale, Seed, Size, Model`` (plus ``Denoising
    strength`` for edits and ``Frames, FPS`` for videos)."""
    lines = [fields["prompt"]]
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
        model, plus true_cfg_scale for models that use it (Qwen-Image, Flux) and strength for
        edits. A guidance the model does not use is null in the JSON and left out of
        ``parameters``.
    """
    fields = generation_fields(prompt, params, seed, model)
    return {"parameters": parameters_text(fields), "diffserve": json.dumps(fields, ensure_ascii=False)}


def video_metadata(prompt: str, params: "SamplingParams", seed: int, model: str) -> dict[str, str]:
    """MP4 container tags describing one generated video: ``comment`` (A1111-style text) and
    ``diffserve`` (JSON, with num_frames and fps)."""
    fields = generation_fields(prompt, params, seed, model)
    return {"comment": parameters_text(fields), "diffserve": json.dumps(fields, ensure_ascii=False)}


class OutputWriter:
    """Writes ``NNNN_seedS.EXT`` files (see the module docstring), numbering after the highest
    ``NNNN_`` already in the folder; creates the folder at the first write (and
    `remove_if_empty` undoes that).

    Args:
        out_dir: the output folder.
        display_size: when set, also upscale outputs (nearest neighbour) to this many pixels on
            the long side; the raw output is kept as ``*_raw.EXT``.
    """

    _NUMBERED = re.compile(r"([0-9]{4,})_")

    def __init__(self, out_dir: Path, display_size: int | None):
        self.out_dir = out_dir
        self.display_size = display_size
        self._created: list[Path] = []
        self._next: int | None = None

    def _stem(self, seed: int) -> str:
        if self._next is None:
            self._make_dir()
            numbers = [int(m.group(1)) for p in self.out_dir.iterdir() if (m := self._NUMBERED.match(p.name))]
            self._next = max(numbers, default=0) + 1
        stem = f"{self._next:04d}_seed{seed}"
        self._next += 1
        return stem

    def _display_size(self, width: int, height: int, even: bool = False) -> tuple[int, int]:
        scale = self.display_size / max(width, height)
        size = [max(1, round(width * scale)), max(1, round(height * scale))]
        if even:  # H.264 4:2:0 needs even sides
            size = [s + s % 2 for s in size]
        return size[0], size[1]

    def write(self, image: "Image.Image", seed: int, text: dict[str, str]) -> Path:
        """Write one PNG with `text` as its text chunks; returns its path."""
        from PIL import Image, PngImagePlugin

        stem = self._stem(seed)
        info = PngImagePlugin.PngInfo()
        for key, value in text.items():
            info.add_text(key, value)  # iTXt (UTF-8) when the text is not Latin-1
        if self.display_size:
            image.save(self.out_dir / f"{stem}_raw.png", pnginfo=info)
            image = image.resize(self._display_size(*image.size), Image.Resampling.NEAREST)
        path = self.out_dir / f"{stem}.png"
        image.save(path, pnginfo=info)
        return path

    def write_video(self, frames: Any, seed: int, fps: int, video_format: str, metadata: dict[str, str]) -> Path:
        """Write one video (uint8 frames (F, H, W, 3)) as ``mp4`` (metadata as container tags),
        ``webp`` or ``gif`` (metadata in a sidecar ``.json``: the ``diffserve`` JSON); returns
        its path.

        Raises:
            ValueError: from the encoder (e.g. odd sides for mp4).
        """
        import numpy as np
        from PIL import Image

        from diffserve.entrypoints.video_encoding import VIDEO_FORMATS, as_frames, encode_mp4, encode_video

        frames = as_frames(frames)
        extension = VIDEO_FORMATS[video_format][0]

        def encode(video: np.ndarray) -> bytes:
            if video_format == "mp4":
                return encode_mp4(video, fps, metadata=metadata)
            return encode_video(video, fps, video_format)

        stem = self._stem(seed)
        if self.display_size:
            (self.out_dir / f"{stem}_raw{extension}").write_bytes(encode(frames))
            size = self._display_size(frames.shape[2], frames.shape[1], even=video_format == "mp4")
            frames = np.stack([np.asarray(Image.fromarray(f).resize(size, Image.Resampling.NEAREST)) for f in frames])
        path = self.out_dir / f"{stem}{extension}"
        path.write_bytes(encode(frames))
        if video_format != "mp4":
            (self.out_dir / f"{stem}.json").write_text(metadata["diffserve"] + "\n", encoding="utf-8")
        return path

    def check_writable(self) -> None:
        """Check, before any compute, that the folder exists as a writable folder or can be
        created (its nearest existing parent is a writable folder).

        Raises:
            InvalidRequestError: field ``output_dir``.
        """
        probe = self.out_dir
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        if not probe.is_dir():
            raise InvalidRequestError("output_dir", str(self.out_dir), "a writable folder",
                                      detail=f"{probe}: not a folder")
        try:  # a real write (permission bits say little for root, or on /proc and read-only mounts)
            os.rmdir(tempfile.mkdtemp(prefix=".diffserve-probe-", dir=probe))
        except OSError as exc:
            raise InvalidRequestError("output_dir", str(self.out_dir), "a writable folder",
                                      detail=f"{probe}: {exc.strerror}") from None

    def _make_dir(self) -> None:
        missing = []
        probe = self.out_dir
        while not probe.exists() and probe.parent != probe:
            missing.append(probe)
            probe = probe.parent
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidRequestError("output_dir", str(self.out_dir), "a writable folder",
                                      detail=exc.strerror) from None
        self._created = missing

    def remove_if_empty(self) -> None:
        """Remove the folders this writer created, if they hold nothing."""
        for folder in self._created:  # deepest first
            try:
                folder.rmdir()
            except OSError:
                return
