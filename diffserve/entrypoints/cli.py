"""The ``diffserve`` command line: ``diffserve generate`` (offline) and ``diffserve serve``
(OpenAI-compatible HTTP server).

Bad arguments print one line ``diffserve: error: ...`` and exit with status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from diffserve import __version__
from diffserve.errors import EngineOverloadedError, InvalidRequestError, UnsupportedModelError

EXIT_USAGE = 2


class _ArgumentParser(argparse.ArgumentParser):
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
    parser.add_argument("--model", default=None,
                        help="local diffusers folder (default: the built-in digits model)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto, fp32, bf16, fp16")
    parser.add_argument("--load-format", default="default", choices=["default", "dummy"])
    parser.add_argument("--max-batch-size", type=int, default=16,
                        help="most transformer rows per denoising step (CFG counts 2 rows per "
                             "image; a larger request runs alone) (default 16)")
    parser.add_argument("--execution-mode", default="step", choices=["step", "request"])
    parser.add_argument("--max-num-inference-steps", type=int, default=200,
                        help="most denoising steps a request may ask for (default 200)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-context-folding", dest="context_folding", action="store_false",
                        help="run SD3's 256 zero T5 placeholder tokens in full instead of as one "
                             "folded token (slower; same images within float rounding)")
    parser.add_argument("--prompt-embed-cache-size", type=int, default=256,
                        help="entries of the prompt-embedding LRU cache (0 = off)")
    parser.add_argument("--cache-backend", default="none", choices=["none", "teacache", "cache_dit"],
                        help="step caching backend (state reset for every request)")
    parser.add_argument("--cache-config", default=None, metavar="JSON",
                        help='cache backend options as a JSON object, e.g. \'{"rel_l1_thresh": 0.4}\'')
    compile_group = parser.add_mutually_exclusive_group()
    compile_group.add_argument("--compile", dest="compile", action="store_true", default=False,
                               help="regional torch.compile of the transformer blocks (warmed up at start)")
    compile_group.add_argument("--enforce-eager", dest="compile", action="store_false",
                               help="never compile (the default)")
    parser.add_argument("--compile-vae", action="store_true", help="with --compile: also compile the VAE decoder")


def engine_config_from_args(args: argparse.Namespace):
    """Build an `EngineConfig` from parsed engine arguments."""
    import json

    from diffserve.config import EngineConfig

    cache_config = {}
    if args.cache_config is not None:
        try:
            cache_config = json.loads(args.cache_config)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("cache_config", args.cache_config, "a JSON object",
                                      detail=str(exc)) from exc
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
        cache_config=cache_config,
        compile=args.compile,
        compile_vae=args.compile_vae,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="diffserve", description="Serve diffusion models fast.")
    parser.add_argument("--version", action="version", version=f"diffserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)
    gen = sub.add_parser("generate", help="generate images offline and write PNG files")
    add_engine_arguments(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default=None)
    gen.add_argument("-n", "--num-images", type=int, default=1,
                     help="images to generate; image i uses seed SEED+i (default 1)")
    gen.add_argument("--steps", type=int, default=None,
                     help="num_inference_steps (default: the model's; 20 for the built-in model)")
    gen.add_argument("--guidance", type=float, default=None,
                     help="guidance_scale in [0, 100], CFG on when > 1 (default: the model's; 4 "
                          "for the built-in model)")
    gen.add_argument("--size", default=None,
                     help="WIDTHxHEIGHT in pixels (default: the model's; 8x8 for the built-in model, "
                          "which supports at most 8x8)")
    gen.add_argument("--seed", type=int, default=None, help="seed of the first image (default: random, printed)")
    gen.add_argument("--display-size", type=int, default=None,
                     help="also upscale images (nearest neighbour) to this many pixels on the "
                          "long side for viewing; the raw output is kept as *_raw.png")
    gen.add_argument("-o", "--output-dir", default="outputs", help="folder for the PNG files (default outputs)")
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (POST /v1/images/generations)")
    add_engine_arguments(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None,
                     help="model name in /v1/models and requests (default: the model folder's name, "
                          "or diffserve-digits for the built-in model)")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="waiting-queue bound; past it requests get 429")
    srv.add_argument("--image-url-ttl", type=float, default=3600.0,
                     help="seconds a response_format=url image stays downloadable")
    srv.add_argument("--max-stored-images", type=int, default=256,
                     help="most images kept in memory for URLs (oldest evicted first)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM/SIGINT, seconds in-flight requests may finish before being aborted")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


MAX_DISPLAY_SIZE = 4096


def _prepare_output_dir(path: str) -> Path:
    """Create the output folder up front, so a bad path fails before any compute.

    Raises:
        InvalidRequestError: the folder cannot be created or written.
    """
    out_dir = Path(path)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidRequestError("output_dir", path, "a writable directory", detail=exc.strerror) from None
    if not os.access(out_dir, os.W_OK):
        raise InvalidRequestError("output_dir", path, "a writable directory")
    return out_dir


def _generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from diffserve.engine.engine import DiffusionEngine
    from diffserve.outputs import EventType
    from diffserve.sampling_params import MAX_SEED, SamplingParams

    if args.display_size is not None and not 1 <= args.display_size <= MAX_DISPLAY_SIZE:
        raise InvalidRequestError("display_size", args.display_size, f"an integer in [1, {MAX_DISPLAY_SIZE}]")
    width = height = None
    if args.size is not None:
        width, height = parse_size(args.size)
    config = engine_config_from_args(args)
    if not 1 <= args.num_images <= config.max_num_images_per_prompt:
        raise InvalidRequestError("num_images", args.num_images,
                                  f"an integer in [1, {config.max_num_images_per_prompt}]")
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED - args.num_images:
        raise InvalidRequestError("seed", args.seed, f"an integer in [0, {MAX_SEED - args.num_images}]")
    out_dir = _prepare_output_dir(args.output_dir)
    # one request per image, seeds seed, seed+1, ...: every file reproduces alone from its seed
    # (the HTTP server's `n` does the same); the engine batches them.
    params = [
        SamplingParams(
            negative_prompt=args.negative_prompt,
            height=height,
            width=width,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            seed=None if args.seed is None else args.seed + i,
        )
        for i in range(args.num_images)
    ]
    engine = DiffusionEngine(config)
    if args.model is None:
        from diffserve.models.digits import out_of_vocabulary_words

        unknown = out_of_vocabulary_words(args.prompt)
        if unknown:
            print(f"diffserve: warning: words outside the default model's vocabulary are "
                  f"spelled out byte by byte and mostly ignored: {', '.join(unknown)}",
                  file=sys.stderr)
    ids = [engine.add_request(args.prompt, p) for p in params]
    steps = params[0].resolve(engine.runner.spec, config.limits, 0).num_inference_steps
    bar = tqdm(total=steps * len(ids), desc="denoising", unit="step", file=sys.stderr)
    outputs = {}
    while len(outputs) < len(ids):
        for event in engine.step():
            if event.type is EventType.PROGRESS:
                bar.update(1)
            elif event.type.is_final:
                outputs[event.request_id] = event.output
    bar.close()
    status = 0
    for output in (outputs[i] for i in ids):
        if not output.ok:
            print(f"diffserve: error: generation failed: {output.error}", file=sys.stderr)
            status = 1
            continue
        if output.prompt_truncated:
            print("diffserve: warning: the prompt was longer than the text encoder's limit and was "
                  "truncated", file=sys.stderr)
        image = output.images[0]
        stem = f"{output.request_id[:8]}_seed{output.seed}"
        if args.display_size:
            from PIL import Image

            image.save(out_dir / f"{stem}_raw.png")
            scale = args.display_size / max(image.size)
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, Image.Resampling.NEAREST)
        path = out_dir / f"{stem}.png"
        image.save(path)
        print(path)
        m = output.metrics
        print(f"seed={output.seed} encode={m.encode_s:.3f}s denoise={m.denoise_s:.3f}s "
              f"decode={m.decode_s:.3f}s total={m.total_s:.3f}s "
              f"peak_memory={m.peak_memory_bytes / 2**20:.0f}MiB", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``diffserve`` command; returns the process exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # transformers warns at import about optional packages (torchvision) the CLI never uses
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            from diffserve.entrypoints.openai.api_server import run_server

            return run_server(args)
    except (InvalidRequestError, UnsupportedModelError, EngineOverloadedError) as exc:
        print(f"diffserve: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
