"""The ``diffserve`` command line: ``diffserve generate`` and ``diffserve edit`` (offline),
``diffserve serve`` (OpenAI-compatible HTTP server) and ``diffserve calibrate-cache`` (a model
folder's step-caching calibration, `diffserve.entrypoints.calibrate_cache`).

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

``--model`` takes a local diffusers folder, a built-in model name (``digits``, the default;
``digits-video``) or a Hugging Face Hub id (``ORG/NAME[@REVISION]``), see `diffserve.models`;
``diffserve download ORG/NAME`` fetches a Hub model without serving it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diffserve.core.errors import EngineOverloadedError, InvalidRequestError, UnsupportedModelError
from diffserve.entrypoints.cli_args import EXIT_USAGE, MAX_DISPLAY_SIZE, build_parser, parse_size, usage_error_message
from diffserve.entrypoints.engine_args import check_engine_arguments, engine_config_from_args
from diffserve.entrypoints.model_name import model_name
from diffserve.entrypoints.output_files import OutputWriter
from diffserve.media.metadata import image_metadata, video_metadata
from diffserve.models import builtin_name

if TYPE_CHECKING:
    from diffserve.core.sampling_params import SamplingParams


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
    params: "SamplingParams"
    num_outputs: int
    out_dir: Path
    images: list[Any] | None = None  # PIL images (edit)
    mask: Any = None
    lora_paths: dict[str, str] | None = None  # --lora files and folders, loaded at start by name


def lora_uses(values: list[str] | None) -> tuple[dict[str, float] | None, dict[str, str]]:
    """``generate --lora PATH[:SCALE]`` options: the requests' ``loras`` ({name: scale}) and the
    files / folders to load at start ({name: path}; a file's name is its stem, a folder's its
    name). A value that is no existing path is a name the engine resolves (the model's own
    adapters, ``--lora-dir``).

    Raises:
        InvalidRequestError: (field ``loras``) a bad value, or one adapter given twice.
    """
    from diffserve.entrypoints.cli_args import parse_lora_use

    loras: dict[str, float] = {}
    paths: dict[str, str] = {}
    for value in values or ():
        source, scale = parse_lora_use(value)
        path = Path(source).expanduser()
        name = path.name.removesuffix(".safetensors") if path.exists() else source
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name):
            name = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip("._-")[:128] or "lora"
        if name in loras:
            raise InvalidRequestError("loras", value, "each LoRA adapter once")
        loras[name] = scale
        if path.exists():
            paths[name] = str(path)
    return loras or None, paths


def check_generate_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> _Job:
    """Every ``generate`` / ``edit`` check that needs no model, before anything heavy is imported
    (input images are read and decoded here too).

    Returns:
        The prompt, the `SamplingParams` of every output (output ``i`` runs with seed
        ``seed + i``: see `diffserve.engine.input_processor`), their number, the output folder,
        and for ``edit`` the input images and mask.

    Raises:
        InvalidRequestError: naming the field (mapped to its flag by `usage_error_message`).
    """
    from diffserve.core.sampling_params import (MAX_SEED, SAMPLER_NAMES, ModelSpec, RequestLimits, SamplingParams,
                                                validate_prompt)

    prompt = _prompt(args, parser)
    if prompt.strip() or _takes_a_prompt(args.model):  # an unconditional model takes "" (checked once loaded)
        validate_prompt(prompt)
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
    loras, lora_paths = lora_uses(args.lora_uses)
    # one request per output, seeds seed, seed+1, ... (the engine's input processor, as for the HTTP
    # server's `n`): every file reproduces alone from its seed; the engine batches them.
    params = SamplingParams(negative_prompt=args.negative_prompt, height=height, width=width,
                            num_inference_steps=args.steps, guidance_scale=args.guidance,
                            true_cfg_scale=args.true_cfg_scale, strength=getattr(args, "strength", None),
                            num_frames=getattr(args, "num_frames", None), fps=getattr(args, "fps", None),
                            seed=args.seed, extra=_extra(args.extra), loras=loras, scheduler=args.scheduler,
                            clip_skip=args.clip_skip, eta=args.eta, cache_quality=args.cache_quality,
                            priority=args.priority, deadline_s=args.deadline_s)
    # The model-independent range checks (steps, guidance, seed, negative prompt, size > 0, strength,
    # frames, fps); the model's own rules (resolution multiple, maximum size, frame rule) are checked
    # once it is loaded.
    any_model = ModelSpec(resolution_factor=1, default_height=1, default_width=1, default_num_inference_steps=1,
                          default_guidance_scale=0.0, default_true_cfg_scale=1.0, default_num_frames=1,
                          default_fps=1, accepts_images=True, default_strength=1.0, samplers=SAMPLER_NAMES,
                          max_clip_skip=2**31)
    # (extra parameters are the loaded pipeline's to check)
    dataclasses.replace(params, extra=None).resolve(any_model, limits, default_seed=0)
    job = _Job(prompt, params, n, _check_output_dir(args.output_dir), lora_paths=lora_paths)
    if args.command == "edit":
        job.images = [_read_image_file(path, "image") for path in args.image]
        if args.mask is not None:
            from diffserve.core.inputs import check_mask_size, mask_from_image

            job.mask = mask_from_image(_read_image_file(args.mask, "mask"))
            check_mask_size(job.images[0].size, job.mask.size)
    return job


def _takes_a_prompt(model: str | None) -> bool:
    """Whether `model` (a local folder or built-in name) reads a prompt, judged from its
    model_index.json before anything loads (`diffserve.models.model_index.takes_a_prompt`);
    True when unknown (a Hub id, a folder that cannot be read)."""
    from diffserve.models import resolve_model
    from diffserve.models.hub import parse_hub_id
    from diffserve.models.model_index import takes_a_prompt

    if parse_hub_id(model) is not None:
        return True
    return takes_a_prompt(resolve_model(model)) is not False


def _extra(items: list[str] | None) -> dict[str, Any] | None:
    """``--extra KEY=JSON`` options as a dict (the value is JSON: ``pag_scale=3``,
    ``eta=0.5``, ``use_resolution_binning=false``, ``'clean_caption="off"'``...).

    Raises:
        InvalidRequestError: field ``extra``: not ``KEY=JSON``, or the value is not JSON.
    """
    if not items:
        return None
    import json

    extra: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise InvalidRequestError("extra", item, "KEY=JSON, e.g. pag_scale=3.0")
        try:
            extra[key] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("extra", item, "KEY=JSON, with a JSON value (strings in double quotes)",
                                      detail=str(exc)) from None
    return extra


def _read_image_file(path: str, field: str):
    """The image in the file `path` (see `diffserve.core.inputs.read_image`).

    Raises:
        InvalidRequestError: naming `field`: unreadable file, or not a valid image.
    """
    from diffserve.core.inputs import read_image

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
    writer = OutputWriter(job.out_dir, args.display_size)
    writer.check_writable()  # before loading the model
    from diffserve.core.library_warnings import silence_inapplicable_library_warnings

    silence_inapplicable_library_warnings()
    config = engine_config_from_args(args)  # imports torch from here on
    from diffserve.models.model_index import check_stated_limits

    check_stated_limits(config.model_path, job.params)  # the limits the model states, before its weights load
    if job.lora_paths:
        config = dataclasses.replace(config, loras={**config.loras, **job.lora_paths})
    from diffserve.engine.client import DiffusionEngine

    engine = DiffusionEngine(config)
    try:
        return _run_generate(engine, args, job, writer)
    finally:
        engine.shutdown()  # a multi-stage model's AR stage runs threads until then


def _run_generate(engine, args: argparse.Namespace, job: _Job, writer: OutputWriter) -> int:
    """Run `job` on the loaded `engine`, write its outputs with `writer` and print their paths;
    the exit status (1 where a generation failed)."""
    from tqdm import tqdm

    from diffserve.core.outputs import EventType

    prompt, params = job.prompt, job.params
    spec = engine.spec
    is_video = spec.default_num_frames is not None
    if args.command == "generate" and args.video_format is not None and not is_video:
        raise InvalidRequestError("video_format", args.video_format, f"unset: {spec.pipeline} makes images")
    inputs = None
    if job.images is not None:
        if not spec.accepts_images:
            raise InvalidRequestError("image", args.image[0], f"unset: {spec.pipeline} takes no input images")
        from diffserve.core.inputs import make_inputs

        inputs = make_inputs(job.images, job.mask)
    if is_video:
        params = dataclasses.replace(params, output_type="np")
    # the model's and the family's rules (size, input images, mask, strength), the seeds and the steps each
    # request runs, before any compute; an edit without --size keeps the input's size (rounded to the model's multiple)
    requests = engine.input_processor.process(prompt, params, inputs, n=job.num_outputs, size_from_inputs=True)
    engine.check_loras(requests[0].params.loras)  # adapter names the engine knows, before the progress bar
    if builtin_name(args.model) == "digits":
        _warn_out_of_vocabulary(prompt)
    totals = [r.num_steps for r in requests]
    bar = tqdm(total=sum(totals), desc="denoising", unit="step", file=sys.stderr)
    order: dict[str, int] = {}

    def on_event(event) -> None:
        if event.type is EventType.QUEUED:
            order[event.request_id] = len(order)
        elif event.type is EventType.PROGRESS:
            index = order[event.request_id]
            if event.total is not None and totals[index] != event.total:  # img2img: strength x steps
                totals[index] = event.total
                bar.total = sum(totals)
            bar.update(1)

    ordered = engine.generate(requests, on_event=on_event)
    bar.close()
    if any(o.ok and o.prompt_truncated for o in ordered):
        limit = f" of {spec.max_prompt_tokens} tokens" if spec.max_prompt_tokens else ""
        print(f"diffserve: warning: the prompt is longer than the text encoder's limit{limit} and was truncated",
              file=sys.stderr)
    if any(o.ok and o.negative_prompt_truncated for o in ordered):
        limit = f" of {spec.max_prompt_tokens} tokens" if spec.max_prompt_tokens else ""
        print(f"diffserve: warning: the negative prompt is longer than the text encoder's limit{limit} and was "
              "truncated", file=sys.stderr)
    status = 0
    name = model_name(args.model)
    video_format = getattr(args, "video_format", None) or "mp4"
    try:
        for output, request in zip(ordered, requests):
            if not output.ok:
                print(f"diffserve: error: generation failed: {output.error}", file=sys.stderr)
                status = 1
                continue
            used = request.params
            if inputs is not None and used.strength is None:
                used = dataclasses.replace(used, strength=spec.default_strength)  # the strength the edit ran with
            keep = args.output_metadata
            if is_video:
                path = writer.write_video(output.videos[0], output.seed, used.fps, video_format,
                                          video_metadata(prompt, used, output.seed, name) if keep else None)
            else:
                path = writer.write(output.images[0], output.seed,
                                    image_metadata(prompt, used, output.seed, name) if keep else None)
            print(path)
            m = output.metrics
            if output.ar_text is not None:  # a multi-stage model's AR stage wrote text (e.g. its answer)
                print(f"ar_text: {output.ar_text}", file=sys.stderr)
            stages = (f"ar={m.ar_s:.3f}s transfer={m.transfer_s:.3f}s payload_wait={m.payload_wait_s:.3f}s "
                      if m.payload_bytes else "")
            print(f"seed={output.seed} {stages}encode={m.encode_s:.3f}s denoise={m.denoise_s:.3f}s "
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


#: Top-level modules of the ``serve`` extra (a missing one: ``pip install 'diffserve[serve]'``).
_SERVE_MODULES = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "multipart", "python_multipart")


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


def _download(args: argparse.Namespace) -> int:
    """``diffserve download ORG/NAME[@REV]``: fetch what the model's pipeline needs, print the folder."""
    from diffserve.models.hub import download_model, parse_hub_id

    hub_id = parse_hub_id(args.model)
    if hub_id is None:
        raise InvalidRequestError("model", args.model, "a Hugging Face Hub id ORG/NAME[@REVISION] (not a local path)")
    print(download_model(hub_id, args.download_dir, args.variant))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``diffserve`` command; returns the process exit status."""
    argv = _attach_dash_values(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "compile", False):  # what is compiled and how long it takes (tens of seconds at start)
        logging.getLogger("diffserve.acceleration.compile").setLevel(logging.INFO)
    command = parser.commands[args.command]
    try:
        if args.command in ("generate", "edit"):
            return _generate(args, command)
        if args.command == "download":
            return _download(args)
        if args.command == "calibrate-cache":
            from diffserve.entrypoints.calibrate_cache import run as calibrate_cache

            return calibrate_cache(args)
        if args.command == "serve":
            from diffserve.core.library_warnings import silence_inapplicable_library_warnings
            from diffserve.entrypoints.server_args import check_server_arguments

            check_engine_arguments(args)
            check_server_arguments(args)
            silence_inapplicable_library_warnings()
            if args.replicas is not None:
                return _serve_replicas(args)
            try:
                from diffserve.entrypoints.openai.server import run_server
            except ImportError as exc:
                missing = (exc.name or "").split(".")[0]
                if missing not in _SERVE_MODULES:
                    raise
                print(f"diffserve: error: serve needs the HTTP server's packages ({missing} is missing): "
                      "pip install 'diffserve[serve]'", file=sys.stderr)
                return EXIT_USAGE
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
