"""The ``diffserve`` command line: ``diffserve generate`` and ``diffserve edit`` (offline) and
``diffserve serve`` (OpenAI-compatible HTTP server).

Start-up: arguments are parsed and every check that needs no model (ranges of ``--steps``,
``-n``, ``--guidance``, ``--seed``, ``--size`` syntax, the prompt's text, the output folder) is
done before torch, diffusers or transformers are imported, so ``--help`` and a mistyped flag
answer at once. Bad arguments print one line ``diffserve: error: argument FLAG: ...`` naming the
flag as typed (``-n`` or ``--num-images``) and exit with status 2, never a traceback.

Output files (``generate``, ``edit``): ``NNNN_seedS.png`` in the output folder (``.mp4``, or
``.webp`` / ``.gif`` with ``--video-format``, for video models), numbered after the highest
number already there (so names sort in generation order across runs), each carrying its
generation parameters (see `diffserve.entrypoints.output_files`). The folder is created only
when there is something to write.

``--model`` takes a local diffusers folder or a built-in model name (``digits``, the default;
``digits-video``), see `diffserve.models`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffserve import __version__
from diffserve.entrypoints.model_name import model_name
from diffserve.entrypoints.output_files import OutputWriter, png_metadata, video_metadata
from diffserve.errors import EngineOverloadedError, InvalidRequestError, UnsupportedModelError
from diffserve.models import builtin_name

if TYPE_CHECKING:
    from diffserve.sampling_params import SamplingParams

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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by ``generate`` and ``serve``."""
    parser.add_argument("--model", default=None, metavar="DIR|NAME",
                        help="a local diffusers folder (model_index.json), or a built-in model: digits "
                             "(text-to-image and image-to-image; the default) or digits-video (text-to-video)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="weights and activations dtype; auto = bf16 on cuda, fp32 on cpu")
    parser.add_argument("--load-format", default="default", choices=["default", "dummy"],
                        help="default reads the weights; dummy builds the models from their configs with "
                             "seeded random weights (for benchmarks)")
    parser.add_argument("--max-batch-size", type=int, default=16, metavar="ROWS",
                        help="most transformer rows per denoising step (CFG counts 2 rows per image; a larger "
                             "request runs alone)")
    parser.add_argument("--execution-mode", default="step", choices=["step", "request"],
                        help="step = continuous batching (requests join and leave between steps); request = "
                             "static batches run to completion")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch intra-op threads (default: torch's, one per core)")
    parser.add_argument("--max-num-inference-steps", type=int, default=200, metavar="N",
                        help="most denoising steps a request may ask for")
    parser.add_argument("--no-context-folding", dest="context_folding", action="store_false",
                        help="run SD3's 256 zero T5 placeholder tokens and Wan's zero prompt padding rows in "
                             "full instead of as one folded token (slower; same outputs within float rounding)")
    parser.add_argument("--prompt-embed-cache-size", type=int, default=256, metavar="N",
                        help="entries of the prompt-embedding LRU cache (0 = off)")
    parser.add_argument("--cache-backend", default="none", choices=["none", "teacache", "cache_dit"],
                        help="step caching backend (state reset for every request)")
    parser.add_argument("--cache-config", default=None, metavar="JSON",
                        help='cache backend options as a JSON object, e.g. \'{"rel_l1_thresh": 0.4}\' '
                             "(default: the backend's defaults)")
    compile_group = parser.add_mutually_exclusive_group()
    compile_group.add_argument("--compile", dest="compile", action="store_true", default=False,
                               help="regional torch.compile of the transformer blocks (warmed up at start)")
    compile_group.add_argument("--enforce-eager", dest="compile", action="store_false",
                               help="never compile; the default unless --compile is given")
    parser.add_argument("--compile-vae", action="store_true", help="with --compile: also compile the VAE decoder")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="replay the denoiser forward from CUDA graphs captured per row bucket (CUDA only)")
    parser.add_argument("--prompt-embed-cache-bytes", type=int, default=256 << 20, metavar="BYTES",
                        help="byte bound of the prompt-embedding cache")
    parser.add_argument("--custom-pipeline", default=None, metavar="MODULE:CLASS",
                        help="a user class: a PipelineAdapter subclass (step batching) or a pipeline with a "
                             "diffusers-style __call__ (whole-request serving) (default: the folder's class)")
    parser.add_argument("--cfg-parallel-size", type=int, default=1, metavar="N",
                        help="worker processes splitting each forward's rows (2: one CFG branch each)")
    parser.add_argument("--ulysses-degree", type=int, default=1, metavar="N",
                        help="worker processes splitting each forward's token sequence (Ulysses)")
    parser.add_argument("--executor", default="auto", choices=["auto", "inprocess", "multiprocess"],
                        help="auto = in-process for one rank, worker processes for cfg-parallel x ulysses > 1")
    # ---- memory: offload, admission by memory, sleep pool (diffserve.entrypoints.memory_options)
    from diffserve.entrypoints.memory_options import add_memory_arguments

    add_memory_arguments(parser)


def engine_config_from_args(args: argparse.Namespace):
    """Build an `EngineConfig` from parsed engine arguments (imports torch).

    Raises:
        InvalidRequestError: an invalid engine option (field names as in `EngineConfig`).
    """
    from diffserve.config import EngineConfig
    from diffserve.entrypoints.memory_options import memory_config

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_batch_size=args.max_batch_size,
        execution_mode=args.execution_mode,
        max_num_inference_steps=args.max_num_inference_steps,
        num_threads=args.threads,
        prompt_embed_cache_size=args.prompt_embed_cache_size,
        context_folding=args.context_folding,
        cache_backend=args.cache_backend,
        cache_config=_cache_config(args),
        compile=args.compile,
        compile_vae=args.compile_vae,
        cuda_graphs=args.cuda_graphs,
        prompt_embed_cache_bytes=args.prompt_embed_cache_bytes,
        custom_pipeline=args.custom_pipeline,
        cfg_parallel_size=args.cfg_parallel_size,
        ulysses_degree=args.ulysses_degree,
        executor=args.executor,
        **memory_config(args),
    )


def _cache_config(args: argparse.Namespace) -> dict:
    if args.cache_config is None:
        return {}
    try:
        return json.loads(args.cache_config)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("cache_config", args.cache_config, "a JSON object", detail=str(exc)) from None


def check_engine_arguments(args: argparse.Namespace) -> None:
    """The engine-option checks that need no torch (EngineConfig repeats them with the rest).

    Raises:
        InvalidRequestError: naming the option's field.
    """
    if args.threads is not None and args.threads < 1:
        raise InvalidRequestError("threads", args.threads, "an integer >= 1")
    if args.max_batch_size < 1:
        raise InvalidRequestError("max_batch_size", args.max_batch_size, "an integer >= 1")
    if args.prompt_embed_cache_size < 0:
        raise InvalidRequestError("prompt_embed_cache_size", args.prompt_embed_cache_size, "an integer >= 0 (0 = off)")
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", args.device):
        raise InvalidRequestError("device", args.device, "auto, cpu, cuda or cuda:N")
    if not isinstance(_cache_config(args), dict):
        raise InvalidRequestError("cache_config", args.cache_config, "a JSON object")
    if args.compile_vae and not args.compile:
        raise InvalidRequestError("compile_vae", True, "used together with --compile")
    for name in ("cfg_parallel_size", "ulysses_degree", "prompt_embed_cache_bytes"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(name, getattr(args, name), "an integer >= 1")
    from diffserve.memory_size import parse_memory  # torch-free

    parse_memory(getattr(args, "max_memory", None))


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
    parser.add_argument("--display-size", type=int, default=None, metavar="PX",
                        help="also upscale outputs (nearest neighbour) to this many pixels on the long side for "
                             "viewing; the raw output is kept as *_raw.EXT (default: no upscaling)")
    parser.add_argument("-o", "--output-dir", default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                        help="folder for the output files, created when the first one is written")


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
    from diffserve.entrypoints.openai.server_options import add_server_arguments

    add_server_arguments(srv)
    # ---- sleep mode (diffserve.entrypoints.openai.sleep_routes)
    from diffserve.entrypoints.memory_options import add_sleep_server_arguments

    add_sleep_server_arguments(srv)
    parser.commands = {"generate": gen, "edit": edit, "serve": srv}
    return parser


# ----------------------------------------------------------------------------- errors
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
        return f"argument {flag}: invalid value {message[len(own):]}"
    return f"argument {flag}: {message}"


# --------------------------------------------------------------------------- generate
def _prompt(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    if args.prompt is not None and args.prompt_option is not None:
        parser.error("give the prompt once: as PROMPT or as --prompt, not both")
    if args.prompt is None and args.prompt_option is None:
        parser.error(f"a prompt is required: diffserve {args.command} \"a handwritten digit 7\" (or --prompt TEXT)")
    parser._prompt_from_option = args.prompt_option is not None  # type: ignore[attr-defined]
    return args.prompt if args.prompt is not None else args.prompt_option


def _check_output_dir(path: str) -> Path:
    """Check that `path` is a writable folder or can be created, without creating it.

    Raises:
        InvalidRequestError: a file is in the way, or the nearest existing folder is not writable.
    """
    out_dir = Path(path).expanduser()
    probe = out_dir
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise InvalidRequestError("output_dir", path, "a folder, or a path where one can be created",
                                  detail=f"{probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise InvalidRequestError("output_dir", path, "a writable folder", detail=f"{probe} is not writable")
    return out_dir


@dataclass
class _Job:
    """A checked ``generate`` / ``edit`` command, before the model loads."""

    prompt: str
    params: list["SamplingParams"]
    out_dir: Path
    images: list[Any] | None = None  # PIL images (edit)
    mask: Any = None


def check_generate_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> _Job:
    """Every ``generate`` / ``edit`` check that needs no model, before anything heavy is imported
    (input images are read and decoded here too).

    Returns:
        The prompt, one `SamplingParams` per output with seeds seed, seed+1, ..., the output
        folder, and for ``edit`` the input images and mask.

    Raises:
        InvalidRequestError: naming the field (mapped to its flag by `usage_error_message`).
    """
    from diffserve.sampling_params import MAX_SEED, ModelSpec, RequestLimits, SamplingParams, validate_prompt

    prompt = validate_prompt(_prompt(args, parser))
    check_engine_arguments(args)
    if args.display_size is not None and not 1 <= args.display_size <= MAX_DISPLAY_SIZE:
        raise InvalidRequestError("display_size", args.display_size, f"an integer in [1, {MAX_DISPLAY_SIZE}]")
    width = height = None
    if args.size is not None:
        width, height = parse_size(args.size)
    limits = RequestLimits()
    n = args.num_images
    if not 1 <= n <= limits.max_num_images_per_prompt:
        raise InvalidRequestError("num_images", n, f"an integer in [1, {limits.max_num_images_per_prompt}]")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        raise InvalidRequestError("seed", args.seed, f"an integer in [0, {MAX_SEED}]")
    # one request per output, seeds seed, seed+1, ... (mod 2**63): every file reproduces alone from its seed
    # (the HTTP server's `n` does the same); the engine batches them.
    params = [
        SamplingParams(negative_prompt=args.negative_prompt, height=height, width=width,
                       num_inference_steps=args.steps, guidance_scale=args.guidance,
                       true_cfg_scale=args.true_cfg_scale, strength=getattr(args, "strength", None),
                       num_frames=getattr(args, "num_frames", None), fps=getattr(args, "fps", None),
                       seed=None if args.seed is None else (args.seed + i) % (MAX_SEED + 1))
        for i in range(n)
    ]
    # The model-independent range checks (steps, guidance, seed, negative prompt, size > 0, strength,
    # frames, fps); the model's own rules (resolution multiple, maximum size, frame rule) are checked
    # once it is loaded.
    any_model = ModelSpec(resolution_factor=1, default_height=1, default_width=1, default_num_inference_steps=1,
                          default_guidance_scale=0.0, default_true_cfg_scale=1.0, default_num_frames=1,
                          default_fps=1, accepts_images=True, default_strength=1.0)
    for p in params:
        p.resolve(any_model, limits, default_seed=0)
    job = _Job(prompt, params, _check_output_dir(args.output_dir))
    if args.command == "edit":
        job.images = [_read_image_file(path, "image") for path in args.image]
        if args.mask is not None:
            from diffserve.inputs import check_mask_size, mask_from_image

            job.mask = mask_from_image(_read_image_file(args.mask, "mask"))
            check_mask_size(job.images[0].size, job.mask.size)
    return job


def _read_image_file(path: str, field: str):
    """The image in the file `path` (see `diffserve.inputs.read_image`).

    Raises:
        InvalidRequestError: naming `field`: unreadable file, or not a valid image.
    """
    from diffserve.inputs import read_image

    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise InvalidRequestError(field, path, "a readable PNG, JPEG or WebP file", detail=exc.strerror) from None
    try:
        return read_image(data, field)
    except InvalidRequestError as exc:
        raise InvalidRequestError(field, path, exc.allowed, detail=f"{exc.value}" + (
            f": {exc.detail}" if exc.detail else "")) from None


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``diffserve generate`` and ``diffserve edit``."""
    job = check_generate_arguments(args, parser)
    prompt, params = job.prompt, job.params
    writer = OutputWriter(job.out_dir, args.display_size)
    writer.check_writable()  # before loading the model
    from diffserve.runner.library_warnings import silence_inapplicable_library_warnings

    silence_inapplicable_library_warnings()
    config = engine_config_from_args(args)  # imports torch from here on
    from tqdm import tqdm

    from diffserve.engine.engine import DiffusionEngine
    from diffserve.outputs import EventType

    engine = DiffusionEngine(config)
    spec, limits = engine.spec, config.limits
    is_video = spec.default_num_frames is not None
    if args.command == "generate" and args.video_format is not None and not is_video:
        raise InvalidRequestError("video_format", args.video_format, f"unset: {spec.pipeline} makes images")
    inputs = None
    if job.images is not None:
        if not spec.accepts_images:
            raise InvalidRequestError("image", args.image[0], f"unset: {spec.pipeline} takes no input images")
        from diffserve.inputs import auto_size, make_inputs

        inputs = make_inputs(job.images, job.mask)
        if args.size is None:  # an edit keeps the input's size (rounded to the model's multiple)
            width, height = auto_size(job.images[0].size, spec, limits)
            params = [dataclasses.replace(p, width=width, height=height) for p in params]
    if is_video:
        params = [dataclasses.replace(p, output_type="np") for p in params]
    resolved = [p.resolve(spec, limits, 0) for p in params]  # the model's rules, before any compute
    # the family's own rules (input images, mask, strength) and the steps each request runs
    planned = [engine.executor.plan(p, inputs).num_steps for p in resolved]
    if builtin_name(args.model) == "digits":
        _warn_out_of_vocabulary(prompt)
    ids = [engine.add_request(prompt, p, inputs=inputs) for p in params]
    totals = dict(zip(ids, planned))
    bar = tqdm(total=sum(totals.values()), desc="denoising", unit="step", file=sys.stderr)
    outputs = {}
    while len(outputs) < len(ids):
        for event in engine.step():
            if event.type is EventType.PROGRESS:
                if event.total is not None and totals[event.request_id] != event.total:  # img2img: strength x steps
                    totals[event.request_id] = event.total
                    bar.total = sum(totals.values())
                bar.update(1)
            elif event.type.is_final:
                outputs[event.request_id] = event.output
    bar.close()
    ordered = [outputs[i] for i in ids]
    if any(o.ok and o.prompt_truncated for o in ordered):
        limit = f" of {spec.max_prompt_tokens} tokens" if spec.max_prompt_tokens else ""
        print(f"diffserve: warning: the prompt is longer than the text encoder's limit{limit} and was truncated",
              file=sys.stderr)
    status = 0
    name = model_name(args.model)
    video_format = getattr(args, "video_format", None) or "mp4"
    try:
        for output, p in zip(ordered, params):
            if not output.ok:
                print(f"diffserve: error: generation failed: {output.error}", file=sys.stderr)
                status = 1
                continue
            used = p.resolve(spec, limits, default_seed=output.seed)
            if inputs is not None and used.strength is None:
                used.strength = spec.default_strength  # the strength the edit ran with
            if is_video:
                path = writer.write_video(output.videos[0], output.seed, used.fps, video_format,
                                          video_metadata(prompt, used, output.seed, name))
            else:
                path = writer.write(output.images[0], output.seed, png_metadata(prompt, used, output.seed, name))
            print(path)
            m = output.metrics
            print(f"seed={output.seed} encode={m.encode_s:.3f}s denoise={m.denoise_s:.3f}s "
                  f"decode={m.decode_s:.3f}s total={m.total_s:.3f}s "
                  f"peak_memory={m.peak_memory_bytes / 2**20:.0f}MiB", file=sys.stderr)
    except BaseException:
        writer.remove_if_empty()
        raise
    return status


def _warn_out_of_vocabulary(prompt: str) -> None:
    """Warn about words the built-in model's tokenizer spells out byte by byte; a prompt made
    only of symbols (no word at all) gets the same warning."""
    from diffserve.models.digits import out_of_vocabulary_words

    unknown = out_of_vocabulary_words(prompt)
    if not unknown and not re.search(r"[^\W_]", prompt):
        unknown = [prompt.strip()]
    if unknown:
        print("diffserve: warning: words outside the default model's vocabulary are spelled out byte by byte "
              f"and mostly ignored: {', '.join(unknown)}", file=sys.stderr)


def _serve_replicas(args: argparse.Namespace) -> int:
    """``diffserve serve --replicas N``: the replicas on Ray Serve (`diffserve.entrypoints.ray_serve`)."""
    try:
        from diffserve.entrypoints.ray_serve import run_replicas
    except ImportError as exc:
        if not (exc.name or "").startswith("ray"):
            raise
        print("diffserve: error: --replicas needs Ray Serve: pip install 'diffserve[ray]'", file=sys.stderr)
        return EXIT_USAGE
    return run_replicas(args)


def _attach_dash_values(argv: list[str]) -> list[str]:
    """``--size -8x8`` -> ``--size=-8x8``: argparse reads a value that starts with ``-`` and is
    not a plain negative number as the next option ("expected one argument"); attached, the
    value reaches `parse_size`, whose error names the field and the allowed form."""
    out: list[str] = []
    for token in argv:
        if out and out[-1] == "--size" and re.match(r"-[0-9]", token):
            out[-1] = f"--size={token}"
        else:
            out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``diffserve`` command; returns the process exit status."""
    argv = _attach_dash_values(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = parser.commands[args.command]
    try:
        if args.command in ("generate", "edit"):
            return _generate(args, command)
        if args.command == "serve":
            from diffserve.runner.library_warnings import silence_inapplicable_library_warnings
            from diffserve.entrypoints.openai.server_options import check_server_arguments

            check_engine_arguments(args)
            check_server_arguments(args)
            silence_inapplicable_library_warnings()
            if args.replicas is not None:
                return _serve_replicas(args)
            from diffserve.entrypoints.openai.api_server import run_server

            return run_server(args)
    except InvalidRequestError as exc:
        print(f"diffserve: error: {usage_error_message(exc, command, argv)}", file=sys.stderr)
        return EXIT_USAGE
    except (UnsupportedModelError, EngineOverloadedError) as exc:
        print(f"diffserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
