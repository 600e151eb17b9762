"""The generation metadata an output carries: what the CLI's files, the server's images (JSON
``b64_json``, ``url`` and streamed) and its stored videos record about the request that made
them.

Fields (`generation_fields`): prompt, negative_prompt, num_inference_steps, guidance_scale,
seed, width, height, model, and, where the request used them, true_cfg_scale, guidance_scale_2,
strength (edits), num_frames and fps (videos). They travel as (`image_metadata` +
`image_encoding.encode_image`, `video_metadata`):

- PNG: text chunks ``parameters`` (the AUTOMATIC1111 layout, read by A1111's "PNG Info", ComfyUI
  and image sites) and ``diffserve`` (JSON);
- JPEG and WebP: EXIF ``UserComment`` holding the ``parameters`` text (encoded ``UNICODE``:
  UTF-16 big-endian after an 8-byte prefix, EXIF 2.3 sec. 4.6.5; what A1111 writes and reads),
  and an XMP packet with the same text as ``dc:description`` and the JSON as
  ``diffserve:parameters``;
- MP4: container tags written by the encoder (`video_encoding.encode_mp4`): ``comment`` (the
  same ``parameters`` text) and ``diffserve`` (JSON);
- animated WebP / GIF: a sidecar JSON file next to the file (the JSON; written by the CLI,
  `diffserve.entrypoints.output_files`).

`read_image_metadata` reads any of the image forms back.
"""

from __future__ import annotations

import io
import json
import struct
from typing import TYPE_CHECKING, Any
from xml.sax.saxutils import escape

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
    if getattr(params, "extra", None):
        fields["extra"] = _jsonable(params.extra)
    return fields


def _jsonable(value: Any) -> Any:
    """`value` if JSON can hold it, else its ``repr`` (extra arguments given offline may be
    tensors or images)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        return repr(value)


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
    for key, value in (fields.get("extra") or {}).items():
        settings.append(f"{key}: {json.dumps(value, ensure_ascii=False)}")
    lines.append(", ".join(settings))
    return "\n".join(lines)


def image_metadata(prompt: str, params: "SamplingParams", seed: int, model: str) -> dict[str, str]:
    """The metadata of one generated image (written per format by `image_encoding.encode_image`:
    PNG text chunks, or EXIF + XMP).

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


#: EXIF ``UserComment`` character-code prefix of UTF-16 text (EXIF 2.3, table 9).
_UNICODE_PREFIX = b"UNICODE\x00"
#: XMP namespace of the diffserve JSON.
XMP_NAMESPACE = "urn:diffserve:metadata:1.0:"
_DC = "http://purl.org/dc/elements/1.1/"
_RDF = "http://www.w3.org/1999/02/22-rdf-syntax-ns#"


def exif_user_comment(text: str) -> bytes:
    """An EXIF block (``Exif\\0\\0`` + a big-endian TIFF structure, as Pillow's ``exif=``
    takes it for JPEG and WebP) with one tag: the Exif IFD's ``UserComment`` (0x9286,
    UNDEFINED) holding `text` as ``UNICODE`` (UTF-16 big-endian). Written by hand because
    Pillow writes tags it has no type for as BYTE, which EXIF readers (piexif, so A1111) do
    not decode as a comment.

    Layout (byte offsets from the TIFF header): header (8), IFD0 at 8 with one entry pointing
    to the Exif IFD at 26, the Exif IFD with one entry pointing to the comment at 44.
    """
    comment = _UNICODE_PREFIX + text.encode("utf-16-be")
    header = b"MM\x00\x2a" + struct.pack(">I", 8)
    ifd0 = struct.pack(">H", 1) + struct.pack(">HHII", 0x8769, 4, 1, 26) + struct.pack(">I", 0)
    exif_ifd = struct.pack(">H", 1) + struct.pack(">HHII", 0x9286, 7, len(comment), 44) + struct.pack(">I", 0)
    return b"Exif\x00\x00" + header + ifd0 + exif_ifd + comment


def xmp_packet(metadata: dict[str, str]) -> bytes:
    """An XMP packet (UTF-8) with ``dc:description`` = ``metadata["parameters"]`` and
    ``diffserve:parameters`` = ``metadata["diffserve"]`` (the JSON)."""
    return (
        '<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>'
        '<x:xmpmeta xmlns:x="adobe:ns:meta/">'
        f'<rdf:RDF xmlns:rdf="{_RDF}">'
        f'<rdf:Description rdf:about="" xmlns:dc="{_DC}" xmlns:diffserve="{XMP_NAMESPACE}">'
        '<dc:description><rdf:Alt><rdf:li xml:lang="x-default">'
        f'{escape(metadata["parameters"])}</rdf:li></rdf:Alt></dc:description>'
        f'<diffserve:parameters>{escape(metadata["diffserve"])}</diffserve:parameters>'
        '</rdf:Description></rdf:RDF></x:xmpmeta><?xpacket end="w"?>'
    ).encode("utf-8")


def read_image_metadata(data: bytes) -> dict[str, Any]:
    """The generation metadata of an image file's bytes (PNG, JPEG or WebP), as written by
    diffserve (or by A1111: PNG ``parameters`` / EXIF ``UserComment``).

    Returns:
        ``{"parameters": the A1111-style text or None, "diffserve": the JSON as a dict or None}``.

    Raises:
        PIL.UnidentifiedImageError: not an image file.
    """
    from PIL import ExifTags, Image

    image = Image.open(io.BytesIO(data))
    text = dict(getattr(image, "text", None) or {})
    parameters, fields = text.get("parameters"), text.get("diffserve")
    if parameters is None:
        comment = image.getexif().get_ifd(ExifTags.IFD.Exif).get(ExifTags.Base.UserComment)
        if isinstance(comment, bytes) and comment.startswith(_UNICODE_PREFIX):
            parameters = comment[len(_UNICODE_PREFIX):].decode("utf-16-be", errors="replace")
        elif isinstance(comment, bytes) and comment[:8] == b"ASCII\x00\x00\x00":
            parameters = comment[8:].decode("ascii", errors="replace")
    xmp = image.info.get("xmp")
    if xmp and (fields is None or parameters is None):
        xmp_parameters, xmp_fields = _read_xmp(xmp)
        parameters = parameters if parameters is not None else xmp_parameters
        fields = fields if fields is not None else xmp_fields
    return {"parameters": parameters, "diffserve": json.loads(fields) if fields else None}


def _read_xmp(packet: bytes | str) -> tuple[str | None, str | None]:
    """(dc:description, diffserve:parameters) of an XMP packet; None where absent."""
    import xml.etree.ElementTree as ElementTree

    text = packet.decode("utf-8", errors="replace") if isinstance(packet, bytes) else packet
    start, end = text.find("<x:xmpmeta"), text.rfind("</x:xmpmeta>")
    if start < 0 or end < 0:
        return None, None
    try:
        root = ElementTree.fromstring(text[start:end + len("</x:xmpmeta>")])
    except ElementTree.ParseError:
        return None, None
    description = root.find(f".//{{{_DC}}}description//{{{_RDF}}}li")
    fields = root.find(f".//{{{XMP_NAMESPACE}}}parameters")
    return (description.text if description is not None else None,
            fields.text if fields is not None else None)
