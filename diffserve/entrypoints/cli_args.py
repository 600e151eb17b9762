"""The ``diffserve`` command-line parser: the ``generate``, ``edit``, ``serve``, ``download`` and
``calibrate-cache`` sub-commands
with their generation, engine (`diffserve.entrypoints.engine_args`), memory
(`diffserve.entrypoints.memory_options`) and server (`diffserve.entrypoints.server_args`)
options, one-line usage errors naming the flag as typed (`usage_error_message`), exit status 2.
Importing this module imports neither torch nor the engine (``--help`` answers at once).
"""

from __future__ import annotations

import argparse
import re

from diffserve import __version__
from diffserve.core.errors import InvalidRequestError
from diffserve.core.sampling_params import CACHE_QUALITY_LEVELS, SAMPLER_NAMES
from diffserve.entrypoints.engine_args import add_download_arguments, add_engine_arguments

EXIT_USAGE = 2
#: Largest ``--display-size``, pixels.
MAX_DISPLAY_SIZE = 4096
#: Folder ``generate`` writes to by default.
DEFAULT_OUTPUT_DIR = "outputs"

# Field names in `InvalidRequestError`s -> the argparse dest of the flag a user sets them with.
_FIELD_TO_DEST = {
    "num_inference_steps": "steps",
    "num_images_per_prompt": "num_images",
    "guidance_scale": "guidance",
    "height": "size",
    "width": "size",
    "num_threads": "threads",
    "loras": "lora_uses",
}
#: Output formats of video models (``--video-format``).
VIDEO_FORMAT_CHOICES = ("mp4", "webp", "gif")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to every option whose help does not state its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: off)"  # the flag is not given
        return f"{text} (default: %(default)s)"


class _ArgumentParser(argparse.ArgumentParser):
    """One-line errors with exit status 2; knows its sub-command parsers (`commands`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str):  # one line, exit 2
        self.exit(EXIT_USAGE, f"diffserve: error: {message}\n")


def parse_size(text: str) -> tuple[int, int]:
    """Parse ``"WxH"`` into (width, height) pixels.

    Raises:
        InvalidRequestError: not two positive integers separated by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(re.fullmatch(r"[0-9]+", p.strip()) for p in parts):
        raise InvalidRequestError("size", text, "WIDTHxHEIGHT in pixels, e.g. 512x512")
    width, height = (int(p) for p in parts)
    return width, height


def parse_lora_use(text: str) -> tuple[str, float]:
    """``--lora PATH[:SCALE]`` as (PATH or name, scale): the text after the last ``:`` is the
    scale when it reads as a number (so ``C:\\x.safetensors`` keeps its drive letter).

    Raises:
        InvalidRequestError: (field ``loras``) an empty path or scale around the ``:`` (``x:``,
            ``:0.5``; unless that is an existing path), or a scale that is not finite or outside
            [-4, 4].
    """
    import math
    from pathlib import Path

    from diffserve.core.sampling_params import MAX_LORA_SCALE

    source, scale = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            scale = float(tail)
            source = head
        except ValueError:
            pass
    if sep and (not head or not tail.strip()) and not Path(text).expanduser().exists():
        raise InvalidRequestError("loras", text, "PATH[:SCALE]: a LoRA file or folder, or a LoRA name, then "
                                  "optionally ':' and a scale")
    if not source:
        raise InvalidRequestError("loras", text, "PATH[:SCALE]: a LoRA file or folder, or a LoRA name")
    if not math.isfinite(scale) or not -MAX_LORA_SCALE <= scale <= MAX_LORA_SCALE:
        raise InvalidRequestError("loras", text, f"PATH[:SCALE] with SCALE finite in [{-MAX_LORA_SCALE:g}, "
                                  f"{MAX_LORA_SCALE:g}]")
    return source, scale


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt, sampling and output options shared by ``generate`` and ``edit``."""
    parser.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                        help='text description of the output, e.g. "a handwritten digit 7" (or --prompt)')
    parser.add_argument("--prompt", dest="prompt_option", default=None, metavar="TEXT",
                        help="the prompt, as an option instead of the positional PROMPT (default: none)")
    parser.add_argument("--negative-prompt", default=None, metavar="TEXT",
                        help="text for the unconditional CFG branch (default: empty)")
    parser.add_argument("-n", "--num-images", type=int, default=1, metavar="N",
                        help="outputs to generate, 1-10; output i uses seed SEED+i (mod 2**63)")
    parser.add_argument("--steps", type=int, default=None, metavar="S",
                        help="num_inference_steps, 1-200 (default: the model's; 20 for the built-in models)")
    parser.add_argument("--guidance", type=float, default=None, metavar="G",
                        help="guidance_scale in [0, 100], CFG on when > 1 (default: the model's; 4 for the "
                             "built-in models)")
    parser.add_argument("--true-cfg-scale", type=float, default=None, metavar="G",
                        help="true_cfg_scale in [0, 100] (Flux, Qwen-Image): true CFG against --negative-prompt "
                             "when > 1 (default: the model's)")
    parser.add_argument("--size", default=None, metavar="WxH",
                        help="WIDTHxHEIGHT in pixels (default: the model's; 8x8 for the built-in digits model, "
                             "which supports at most 8x8)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed of the first output (default: random, printed)")
    parser.add_argument("--scheduler", default=None, choices=SAMPLER_NAMES, metavar="NAME",
                        help="sampler (A1111's names; each a diffusers scheduler, README 'Samplers'): "
                             f"{', '.join(SAMPLER_NAMES)}; the model offers those its prediction type "
                             "supports (default: the model folder's own scheduler)")
    parser.add_argument("--clip-skip", type=int, default=None, metavar="N",
                        help="CLIP layers skipped from the end for the prompt embeddings (diffusers' clip_skip: 1 = "
                             "the pre-final layer, A1111's 'Clip skip 2'; SD, SDXL, SD3) (default: none)")
    parser.add_argument("--eta", type=float, default=None, metavar="E",
                        help="DDIM eta in [0, 1] (--scheduler ddim) (default: 0)")
    parser.add_argument("--cache-quality", default=None, choices=CACHE_QUALITY_LEVELS, metavar="LEVEL",
                        help="step-caching quality level of these outputs (SamplingParams.cache_quality): "
                             f"{', '.join(CACHE_QUALITY_LEVELS)}; max never skips a step; with --cache-backend "
                             "teacache (default: the engine's, --cache-config cache_quality)")
    parser.add_argument("--priority", type=int, default=0, metavar="P",
                        help="request priority, an integer in [-2**31, 2**31 - 1]; lower is served first under "
                             "--scheduling-policy priority and breaks ties under slo; unused under fcfs "
                             "(default: 0)")
    parser.add_argument("--deadline-s", type=float, default=None, metavar="SECONDS",
                        help="seconds from arrival by which each output should finish, positive and finite: "
                             "least slack first under --scheduling-policy slo (refused at arrival with --admission "
                             "slo when it cannot be met); under fcfs and priority only counted in the SLO "
                             "metrics (default: no deadline)")
    parser.add_argument("--display-size", type=int, default=None, metavar="PX",
                        help="also upscale outputs (nearest neighbour) to this many pixels on the long side for "
                             "viewing; the raw output is kept as *_raw.EXT (default: no upscaling)")
    parser.add_argument("-o", "--output-dir", default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                        help="folder for the output files, created when the first one is written")
    parser.add_argument("--extra", action="append", default=None, metavar="KEY=JSON",
                        help="a further __call__ argument of a pipeline served whole-request (no step adapter), "
                             "e.g. --extra pag_scale=3.0; repeatable; checked against the pipeline's signature "
                             "(default: none)")
    parser.add_argument("--no-output-metadata", dest="output_metadata", action="store_false",
                        help="write the files without their generation parameters (no PNG text chunks, MP4 "
                             "tags or WebP/GIF sidecar .json)")
    parser.add_argument("--lora", dest="lora_uses", action="append", default=None, metavar="PATH[:SCALE]",
                        help="apply a LoRA adapter: a .safetensors file or LoRA folder (any common format), or "
                             "the name of one of the model's own (the built-in digits model: mirror) or of one in "
                             "--lora-dir; SCALE in [-4, 4] (default 1); repeat to compose several")


def build_parser() -> _ArgumentParser:
    """The ``diffserve`` argument parser (``generate``, ``edit`` and ``serve`` sub-commands)."""
    parser = _ArgumentParser(prog="diffserve", description="Serve diffusion models fast.")
    parser.add_argument("--version", action="version", version=f"diffserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate images (PNG) or videos (MP4) offline",
                         description="Generate images (NNNN_seedS.png) or, with a video model, videos "
                                     "(NNNN_seedS.mp4) offline, with the generation parameters as metadata.")
    add_generation_arguments(gen)
    video = gen.add_argument_group("video models")
    video.add_argument("--num-frames", type=int, default=None, metavar="F",
                       help="frames per video (the model's rule, e.g. 4k+1 for Wan) (default: the model's)")
    video.add_argument("--fps", type=int, default=None, metavar="R",
                       help="frames per second of the video, 1-240 (default: the model's)")
    video.add_argument("--video-format", default=None, choices=VIDEO_FORMAT_CHOICES,
                       help="file format: mp4 (H.264, metadata as container tags), webp or gif (animated, "
                            "metadata in a sidecar .json) (default: mp4)")
    add_engine_arguments(gen)
    edit = sub.add_parser("edit", help="edit images offline (image-to-image) and write PNG files",
                          description="Edit images offline: the model redraws --image following PROMPT "
                                      "(NNNN_seedS.png, with the generation parameters as PNG text chunks).")
    edit.add_argument("--image", action="append", required=True, metavar="PATH",
                      help="input image (PNG, JPEG or WebP); repeat for models that take several")
    edit.add_argument("--mask", default=None, metavar="PATH",
                      help="mask of the first image's size (models that inpaint): transparent pixels (or, "
                           "without transparency, white ones) are repainted (default: none)")
    edit.add_argument("--strength", type=float, default=None, metavar="S",
                      help="fraction of the denoising schedule run on the noised input, in (0, 1]: low keeps "
                           "the input, 1 redraws it (default: the model's; 0.6 for the built-in model)")
    add_generation_arguments(edit)
    add_engine_arguments(edit)
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (images, edits, videos)",
                         description="Run the OpenAI-compatible HTTP server.")
    add_engine_arguments(srv)
    srv.add_argument("--lora", dest="lora_loads", action="append", default=None, metavar="NAME=PATH",
                     help="load a LoRA adapter at start under NAME (requests name it in loras); repeatable")
    from diffserve.entrypoints.server_args import add_server_arguments

    add_server_arguments(srv)
    # ---- sleep mode (diffserve.entrypoints.openai.ops.sleep)
    from diffserve.entrypoints.memory_options import add_sleep_server_arguments

    add_sleep_server_arguments(srv)
    download = sub.add_parser("download", help="fetch a model from the Hugging Face Hub without serving it",
                              description="Fetch the files a Hub model's pipeline needs into the Hugging Face "
                                          "cache (or --download-dir) and print the local folder.")
    download.add_argument("model", metavar="ORG/NAME[@REV]", help="a Hugging Face Hub id, with an optional revision")
    add_download_arguments(download)
    calibrate = sub.add_parser("calibrate-cache", help="fit a model folder's step-caching calibration",
                               description="Fit TeaCache's rescaling coefficients and the quality levels' "
                                           "budgets on the model's own uncached trajectories and write them to "
                                           "DIR/diffserve_cache.json, which the engine then uses.")
    from diffserve.entrypoints.calibrate_cache import add_calibrate_arguments

    add_calibrate_arguments(calibrate)
    parser.commands = {"generate": gen, "edit": edit, "serve": srv, "download": download,
                       "calibrate-cache": calibrate}
    return parser


def _typed_flag(action: argparse.Action, argv: list[str]) -> str:
    """The option string of `action` the user typed (``-n`` or ``--num-images``), else its
    longest one; ``PROMPT`` style for positionals."""
    if not action.option_strings:
        return action.metavar or action.dest.upper()
    for token in argv:
        for option in action.option_strings:
            if token == option or token.startswith(option + "=") or (
                    len(option) == 2 and token.startswith(option) and not token.startswith("--")):
                return option
    return max(action.option_strings, key=len)


def usage_error_message(exc: InvalidRequestError, parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """``argument FLAG: invalid value V: must be ...`` for an error on a field set by a flag of
    `parser` (the flag as the user typed it), else the error's own message."""
    field = exc.field.split(".")[0]
    dest = _FIELD_TO_DEST.get(field, field)
    if dest == "prompt" and getattr(parser, "_prompt_from_option", False):
        dest = "prompt_option"
    action = next((a for a in parser._actions if a.dest == dest), None)
    if action is None:
        return str(exc)
    flag = _typed_flag(action, argv)
    message = str(exc)
    own = f"invalid {exc.field}="
    if message.startswith(own) and field not in ("height", "width"):
        if exc.field != field:  # a key inside the flag's JSON: keep its path (levels.fast.interval)
            return f"argument {flag}: invalid {exc.field[len(field) + 1:]}={message[len(own):]}"
        return f"argument {flag}: invalid value {message[len(own):]}"
    return f"argument {flag}: {message}"
