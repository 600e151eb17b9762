"""Encoding generated videos into files: MP4 (H.264), animated WebP and GIF.

Every encoder takes frames as a uint8 array (F, H, W, 3) RGB (what
`GenerationOutput.videos` holds for ``output_type="np"``; a uint8 tensor (F, H, W, 3) or a list
of PIL frames is accepted too) and the playback rate in frames per second, and returns the
file's bytes. MP4 uses FFmpeg's libx264 through PyAV (``av``, whose wheels bundle FFmpeg) into
an in-memory buffer, optionally with metadata tags in the container (FFmpeg's ``movflags=
use_metadata_tags``: any key, read back by ``ffprobe`` or `read_mp4_metadata`); WebP and GIF use
Pillow.
"""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Any

import numpy as np

#: format name -> (file extension, MIME type)
VIDEO_FORMATS = {
    "mp4": (".mp4", "video/mp4"),
    "webp": (".webp", "image/webp"),
    "gif": (".gif", "image/gif"),
}


def as_frames(video: Any) -> np.ndarray:
    """`video` as a C-contiguous uint8 array (F, H, W, 3).

    Args:
        video: uint8 array or tensor (F, H, W, 3), or a list of PIL images of one size.

    Raises:
        ValueError: wrong dtype, rank, channel count, or no frames.
    """
    if isinstance(video, (list, tuple)):
        video = np.stack([np.asarray(frame.convert("RGB")) for frame in video]) if video else np.zeros((0,))
    elif hasattr(video, "numpy") and not isinstance(video, np.ndarray):  # torch tensor
        video = video.detach().cpu().numpy()
    frames = np.asarray(video)
    if frames.dtype != np.uint8:
        raise ValueError(f"video frames must be uint8, got {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"video frames must have shape (F >= 1, H, W, 3), got {frames.shape}")
    return np.ascontiguousarray(frames)


def _check_fps(fps: float) -> float:
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 240:
        raise ValueError(f"fps must be a number in (0, 240], got {fps!r}")
    return fps


def encode_mp4(video: Any, fps: float, crf: int = 18, preset: str = "medium",
               metadata: dict[str, str] | None = None) -> bytes:
    """H.264 MP4 (yuv420p, playable in browsers) of the frames.

    Args:
        video: frames, see `as_frames`; height and width must be even (4:2:0 chroma).
        fps: frames per second, in (0, 240].
        crf: x264 constant rate factor, 0 (lossless luma) .. 51; 18 is visually lossless.
        preset: x264 speed/size preset (``ultrafast`` .. ``veryslow``).
        metadata: container tags (key -> text), e.g. ``comment``; any key is kept.

    Returns:
        The MP4 file's bytes.

    Raises:
        ValueError: bad frames, odd height/width, fps or crf out of range.
    """
    import av

    frames = as_frames(video)
    fps = _check_fps(fps)
    _, height, width, _ = frames.shape
    if height % 2 or width % 2:
        raise ValueError(f"H.264 (yuv420p) needs an even height and width, got {width}x{height}")
    if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
        raise ValueError(f"crf must be an integer in [0, 51], got {crf!r}")
    buffer = io.BytesIO()
    options = {"movflags": "use_metadata_tags"} if metadata else {}
    with av.open(buffer, mode="w", format="mp4", options=options) as container:
        for key, value in (metadata or {}).items():
            container.metadata[key] = value
        stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": preset}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush
    return buffer.getvalue()


def decode_mp4(data: bytes) -> tuple[np.ndarray, float]:
    """Frames and rate of a video file (any container/codec FFmpeg reads).

    Returns:
        (uint8 array (F, H, W, 3) RGB, frames per second).

    Raises:
        ValueError: the data holds no video stream.
    """
    import av

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("no video stream in the data")
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        rate = float(stream.average_rate or stream.base_rate or 0)
    return np.stack(frames), rate


def read_mp4_metadata(data: bytes) -> dict[str, str]:
    """The container tags of a video file (those of `encode_mp4`'s `metadata` included)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return dict(container.metadata)


def _pil_frames(frames: np.ndarray) -> list:
    from PIL import Image

    return [Image.fromarray(frame) for frame in frames]


def encode_webp(video: Any, fps: float, quality: int = 90, lossless: bool = False) -> bytes:
    """Animated WebP of the frames, looping forever.

    Args:
        video: frames, see `as_frames`.
        fps: frames per second, in (0, 240] (frame durations are whole milliseconds).
        quality: 0..100 (lossy), or effort with ``lossless``.

    Raises:
        ValueError: bad frames or fps.
    """
    frames = _pil_frames(as_frames(video))
    duration = round(1000 / _check_fps(fps))
    buffer = io.BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:], duration=duration, loop=0,
                   quality=quality, lossless=lossless)
    return buffer.getvalue()


def encode_gif(video: Any, fps: float) -> bytes:
    """Animated GIF of the frames (256-colour palette per frame), looping forever.

    Args:
        video: frames, see `as_frames`.
        fps: frames per second, in (0, 240]; GIF stores durations in 10 ms units, so the rate
            is rounded (16 fps plays at 1000 / 60 ms = 16.7 fps).

    Raises:
        ValueError: bad frames or fps.
    """
    frames = _pil_frames(as_frames(video))
    duration = max(10, round(100 / _check_fps(fps)) * 10)
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], duration=duration, loop=0)
    return buffer.getvalue()


def encode_video(video: Any, fps: float, video_format: str = "mp4") -> bytes:
    """Encode with the encoder of `video_format` (a key of `VIDEO_FORMATS`).

    Raises:
        ValueError: unknown format, or the encoder's own errors.
    """
    encoders = {"mp4": encode_mp4, "webp": encode_webp, "gif": encode_gif}
    if video_format not in encoders:
        raise ValueError(f"video format must be one of {', '.join(VIDEO_FORMATS)}, got {video_format!r}")
    return encoders[video_format](video, fps)
