"""Files the CLI writes (``diffserve generate`` / ``diffserve edit``).

Naming: ``NNNN_seedS.EXT`` in the output folder, numbered after the highest ``NNNN_`` already
there, so names sort in generation order across runs; each file reproduces alone from its seed.
The folder is created only when there is something to write. Each file carries its generation
metadata (`diffserve.media.metadata`): PNG text chunks, MP4 container tags, or a sidecar
``NNNN_seedS.json`` next to an animated WebP / GIF.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffserve.core.errors import InvalidRequestError

if TYPE_CHECKING:
    from PIL import Image


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

    def write(self, image: "Image.Image", seed: int, text: dict[str, str] | None) -> Path:
        """Write one PNG with `text` as its text chunks (None: none); returns its path."""
        from PIL import Image

        from diffserve.media.image_encoding import encode_image

        stem = self._stem(seed)
        if self.display_size:
            (self.out_dir / f"{stem}_raw.png").write_bytes(encode_image(image, "png", metadata=text))
            image = image.resize(self._display_size(*image.size), Image.Resampling.NEAREST)
        path = self.out_dir / f"{stem}.png"
        path.write_bytes(encode_image(image, "png", metadata=text))
        return path

    def write_video(self, frames: Any, seed: int, fps: int, video_format: str,
                    metadata: dict[str, str] | None) -> Path:
        """Write one video (uint8 frames (F, H, W, 3)) as ``mp4`` (metadata as container tags),
        ``webp`` or ``gif`` (metadata in a sidecar ``.json``: the ``diffserve`` JSON; none
        when `metadata` is None); returns its path.

        Raises:
            ValueError: from the encoder (e.g. odd sides for mp4).
        """
        import numpy as np
        from PIL import Image

        from diffserve.media.video_encoding import VIDEO_FORMATS, as_frames, encode_mp4, encode_video

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
        if video_format != "mp4" and metadata is not None:
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
