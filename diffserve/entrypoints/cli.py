"""The ``diffserve`` command line: ``diffserve generate`` (offline) and ``diffserve serve``
(OpenAI-compatible HTTP server).

Start-up: arguments are parsed and every check that needs no model (ranges of ``--steps``,
``-n``, ``--guidance``, ``--seed``, ``--size`` syntax, the prompt's text, the output folder) is
done before torch, diffusers or transformers are imported, so ``--help`` and a mistyped flag
answer at once. Bad arguments print one line ``diffserve: error: argument FLAG: ...`` naming the
flag as typed (``-n`` or ``--num-images``) and exit with status 2, never a traceback.

Output files (``generate``): ``NNNN_seedS.png`` in the output folder, numbered after the highest
number already there (so names sort in generation order across runs), each carrying its
generation parameters as PNG text chunks: ``parameters`` in the AUTOMATIC1111 layout (read by
A1111, ComfyUI and image sites) and ``diffserve`` as JSON. The folder is created only when
there is an image to write.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffserve import __version__
from diffserve.errors import EngineOverloadedError, InvalidRequestError, UnsupportedModelError

if TYPE_CHECKING:
    from PIL import Image

    from diffserve.outputs import GenerationOutput
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
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="local diffusers folder (model_index.json) (default: the built-in digits model)")
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
                        help="run SD3's 256 zero T5 placeholder tokens in full instead of as one folded token "
                             "(slower; same images within float rounding)")
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


def build_parser() -> _ArgumentParser:
    """The ``diffserve`` argument parser (``generate`` and ``serve`` sub-commands)."""
    parser = _ArgumentParser(prog="diffserve", description="Serve diffusion models fast.")
    parser.add_argument("--version", action="version", version=f"diffserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate images offline and write PNG files",
                         description="Generate images offline and write PNG files (NNNN_seedS.png, with the "
                                     "generation parameters as PNG text chunks).")
    gen.add_argument("prompt", nargs="?", default=None, metavar="PROMPT",
                     help='text description of the image, e.g. "a handwritten digit 7" (or --prompt)')
    gen.add_argument("--prompt", dest="prompt_option", default=None, metavar="TEXT",
                     help="the prompt, as an option instead of the positional PROMPT (default: none)")
    gen.add_argument("--negative-prompt", default=None, metavar="TEXT",
                     help="text for the unconditional CFG branch (default: empty)")
    gen.add_argument("-n", "--num-images", type=int, default=1, metavar="N",
                     help="images to generate, 1-10; image i uses seed SEED+i (mod 2**63)")
    gen.add_argument("--steps", type=int, default=None, metavar="S",
                     help="num_inference_steps, 1-200 (default: the model's; 20 for the built-in model)")
    gen.add_argument("--guidance", type=float, default=None, metavar="G",
                     help="guidance_scale in [0, 100], CFG on when > 1 (default: the model's; 4 for the "
                          "built-in model)")
    gen.add_argument("--true-cfg-scale", type=float, default=None, metavar="G",
                     help="true_cfg_scale in [0, 100] (Flux, Qwen-Image): true CFG against --negative-prompt "
                          "when > 1 (default: the model's)")
    gen.add_argument("--size", default=None, metavar="WxH",
                     help="WIDTHxHEIGHT in pixels (default: the model's; 8x8 for the built-in model, which "
                          "supports at most 8x8)")
    gen.add_argument("--seed", type=int, default=None, metavar="S",
                     help="seed of the first image (default: random, printed)")
    gen.add_argument("--display-size", type=int, default=None, metavar="PX",
                     help="also upscale images (nearest neighbour) to this many pixels on the long side for "
                          "viewing; the raw output is kept as *_raw.png (default: no upscaling)")
    gen.add_argument("-o", "--output-dir", default=DEFAULT_OUTPUT_DIR, metavar="DIR",
                     help="folder for the PNG files, created when the first image is written")
    add_engine_arguments(gen)
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (POST /v1/images/generations)",
                         description="Run the OpenAI-compatible HTTP server.")
    add_engine_arguments(srv)
    from diffserve.entrypoints.openai.server_options import add_server_arguments

    add_server_arguments(srv)
    # ---- sleep mode (diffserve.entrypoints.openai.sleep_routes)
    from diffserve.entrypoints.memory_options import add_sleep_server_arguments

    add_sleep_server_arguments(srv)
    parser.commands = {"generate": gen, "serve": srv}
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
        parser.error('a prompt is required: diffserve generate "a handwritten digit 7" (or --prompt TEXT)')
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


def check_generate_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser
                             ) -> tuple[str, list["SamplingParams"], Path]:
    """Every ``generate`` check that needs no model, before anything heavy is imported.

    Returns:
        (prompt, one `SamplingParams` per image with seeds seed, seed+1, ..., output folder).

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
    # one request per image, seeds seed, seed+1, ... (mod 2**63): every file reproduces alone from its seed
    # (the HTTP server's `n` does the same); the engine batches them.
    params = [
        SamplingParams(negative_prompt=args.negative_prompt, height=height, width=width,
                       num_inference_steps=args.steps, guidance_scale=args.guidance,
                       true_cfg_scale=args.true_cfg_scale,
                       seed=None if args.seed is None else (args.seed + i) % (MAX_SEED + 1))
        for i in range(n)
    ]
    # The model-independent range checks (steps, guidance, seed, negative prompt, size > 0);
    # the model's own rules (resolution multiple, maximum size) are checked once it is loaded.
    any_model = ModelSpec(resolution_factor=1, default_height=1, default_width=1,
                          default_num_inference_steps=1, default_guidance_scale=0.0, default_true_cfg_scale=1.0)
    for p in params:
        p.resolve(any_model, limits, default_seed=0)
    return prompt, params, _check_output_dir(args.output_dir)


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    prompt, params, out_dir = check_generate_arguments(args, parser)
    from diffserve.runner.library_warnings import silence_inapplicable_library_warnings

    silence_inapplicable_library_warnings()
    config = engine_config_from_args(args)  # imports torch from here on
    from tqdm import tqdm

    from diffserve.engine.engine import DiffusionEngine
    from diffserve.outputs import EventType

    engine = DiffusionEngine(config)
    spec, limits = engine.spec, config.limits
    resolved = [p.resolve(spec, limits, 0) for p in params]  # the model's rules, before any compute
    if args.model is None:
        _warn_out_of_vocabulary(prompt)
    ids = [engine.add_request(prompt, p) for p in params]
    bar = tqdm(total=sum(r.num_inference_steps for r in resolved), desc="denoising", unit="step", file=sys.stderr)
    outputs = {}
    while len(outputs) < len(ids):
        for event in engine.step():
            if event.type is EventType.PROGRESS:
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
    writer = _OutputWriter(out_dir, args.display_size)
    from diffserve.entrypoints.model_name import model_name

    name = model_name(args.model)
    try:
        for output, p in zip(ordered, params):
            if not output.ok:
                print(f"diffserve: error: generation failed: {output.error}", file=sys.stderr)
                status = 1
                continue
            used = p.resolve(spec, limits, default_seed=output.seed)
            path = writer.write(output.images[0], output.seed,
                                png_metadata(prompt, used, output.seed, name))
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


def png_metadata(prompt: str, params: "SamplingParams", seed: int, model: str) -> dict[str, str]:
    """PNG text chunks describing one generated image.

    Returns:
        ``{"parameters": A1111-style text, "diffserve": JSON}``; the JSON holds prompt,
        negative_prompt, num_inference_steps, guidance_scale, seed, width, height (pixels) and
        model, plus true_cfg_scale for models that use it (Qwen-Image, Flux). A guidance the
        model does not use is null in the JSON and left out of ``parameters``.
    """
    fields = {
        "prompt": prompt,
        "negative_prompt": params.negative_prompt or "",
        "num_inference_steps": params.num_inference_steps,
        "guidance_scale": params.guidance_scale,
        "seed": seed,
        "width": params.width,
        "height": params.height,
        "model": model,
    }
    true_cfg = getattr(params, "true_cfg_scale", None)
    if true_cfg is not None:
        fields["true_cfg_scale"] = true_cfg
    lines = [prompt]
    if params.negative_prompt:
        lines.append(f"Negative prompt: {params.negative_prompt}")
    cfg = params.guidance_scale if params.guidance_scale is not None else true_cfg
    settings = [f"Steps: {params.num_inference_steps}"] + ([f"CFG scale: {cfg:g}"] if cfg is not None else [])
    settings += [f"Seed: {seed}", f"Size: {params.width}x{params.height}", f"Model: {model}"]
    lines.append(", ".join(settings))
    return {"parameters": "\n".join(lines), "diffserve": json.dumps(fields, ensure_ascii=False)}


class _OutputWriter:
    """Writes ``NNNN_seedS.png`` files, numbering after the highest ``NNNN_`` already in the
    folder; creates the folder at the first write (and `remove_if_empty` undoes that)."""

    _NUMBERED = re.compile(r"([0-9]{4,})_")

    def __init__(self, out_dir: Path, display_size: int | None):
        self.out_dir = out_dir
        self.display_size = display_size
        self._created: list[Path] = []
        self._next: int | None = None

    def write(self, image: "Image.Image", seed: int, text: dict[str, str]) -> Path:
        from PIL import Image, PngImagePlugin

        if self._next is None:
            self._make_dir()
            numbers = [int(m.group(1)) for p in self.out_dir.iterdir() if (m := self._NUMBERED.match(p.name))]
            self._next = max(numbers, default=0) + 1
        stem = f"{self._next:04d}_seed{seed}"
        self._next += 1
        info = PngImagePlugin.PngInfo()
        for key, value in text.items():
            info.add_text(key, value)  # iTXt (UTF-8) when the text is not Latin-1
        if self.display_size:
            image.save(self.out_dir / f"{stem}_raw.png", pnginfo=info)
            scale = self.display_size / max(image.size)
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, Image.Resampling.NEAREST)
        path = self.out_dir / f"{stem}.png"
        image.save(path, pnginfo=info)
        return path

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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``diffserve`` command; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = parser.commands[args.command]
    try:
        if args.command == "generate":
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
