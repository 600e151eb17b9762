"""Engine arguments of the command line (``generate``, ``edit``, ``serve`` and each Ray Serve
replica), as vLLM's ``EngineArgs``: `add_engine_arguments` declares them, `check_engine_arguments`
checks what needs no torch, `engine_config_from_args` builds the `EngineConfig`. Importing this
module imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from diffserve.core.errors import InvalidRequestError


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by ``generate`` and ``serve``."""
    parser.add_argument("--model", default=None, metavar="DIR|NAME|ORG/NAME[@REV]",
                        help="a local diffusers folder (model_index.json), a built-in model: digits "
                             "(text-to-image and image-to-image; the default) or digits-video (text-to-video), "
                             "or a Hugging Face Hub id fetched into the Hub cache (only the files its pipeline "
                             "needs; token: HF_TOKEN; HF_HUB_OFFLINE=1 uses the cache only)")
    add_download_arguments(parser)
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
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "slo"],
                        help="fcfs = arrival order; priority = lowest request priority first; slo = least slack to "
                             "the request's deadline_s first (both preempt at step boundaries; README: Scheduling "
                             "policies)")
    parser.add_argument("--aging-s", type=float, default=60.0, metavar="SECONDS",
                        help="priority/slo: requests older than this are served in arrival order ahead of younger "
                             "ones (the bound on waiting)")
    parser.add_argument("--max-padding-ratio", type=_padding_ratio, default=1.0, metavar="R",
                        help="mixed sizes: most padded share of a forward's image token slots, in [0, 1]; a request "
                             "that would exceed it waits for a later step batch (the oldest, aged requests and "
                             "running ones are exempt); 0 = different token counts never share a forward; "
                             "1 = no cap (default: 1); auto = a request joins only if the step cost model "
                             "predicts no fewer real image tokens per second with it")
    parser.add_argument("--admission", default="all", choices=["all", "slo"],
                        help="slo = refuse at arrival (HTTP 429) a request whose deadline_s the cost model "
                             "predicts it cannot meet")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch intra-op threads (default: torch's, one per core)")
    parser.add_argument("--max-num-inference-steps", type=int, default=200, metavar="N",
                        help="most denoising steps a request may ask for")
    parser.add_argument("--max-num-frames", type=int, default=1025, metavar="N",
                        help="most frames a video request may ask for (video models; also capped by the model)")
    parser.add_argument("--max-num-chunks", type=int, default=1024, metavar="N",
                        help="most chunks a video stream may ask for (POST /v1/videos/streams)")
    parser.add_argument("--no-context-folding", dest="context_folding", action="store_false",
                        help="run SD3's 256 zero T5 placeholder tokens and Wan's zero prompt padding rows in "
                             "full instead of as one folded token (slower; same outputs within float rounding)")
    parser.add_argument("--no-mixed-sizes", dest="mixed_sizes", action="store_false",
                        help="batch requests by size, as before issue 27 (default: SD3-family, Flux, Flux "
                             "Kontext, Qwen-Image and Wan requests of different sizes (Wan: and frame counts) "
                             "share a forward, each row with its own positions and span)")
    parser.add_argument("--no-length-groups", dest="length_groups", action="store_false",
                        help="run a mixed-size forward's blocks once over the padded rows with masks instead of "
                             "once per row size on real tokens only (default: grouped, in eager SD3-family, Flux, "
                             "Flux Kontext, Qwen-Image(-Edit) and Wan forwards; compiled blocks always take "
                             "the padded path)")
    parser.add_argument("--prompt-embed-cache-size", type=int, default=256, metavar="N",
                        help="entries of the prompt-embedding LRU cache (0 = off)")
    parser.add_argument("--cache-backend", default="none", choices=["none", "teacache", "cache_dit"],
                        help="step caching backend (state reset for every request)")
    parser.add_argument("--cache-config", default=None, metavar="JSON",
                        help='cache backend options as a JSON object, e.g. \'{"cache_quality": "fast"}\' '
                             "(teacache: the default quality level of requests: max|high|balanced|fast) or "
                             '\'{"rel_l1_thresh": 0.4}\' (plain TeaCache); default: the backend\'s defaults')
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
    # ---- LoRA adapters (diffserve.lora; the request side: generate --lora, serve --lora, HTTP loras)
    loras = parser.add_argument_group("LoRA adapters")
    loras.add_argument("--lora-dir", default=None, metavar="DIR",
                       help="folder whose NAME.safetensors files and NAME/ folders load the first time a request "
                            "names NAME (beside the steps); the only place POST /v1/loras loads from "
                            "(default: none)")
    loras.add_argument("--max-loras", type=int, default=4, metavar="N",
                       help="device slots for LoRA adapters: the most distinct adapters running requests use at "
                            "once (another waits in the queue), and per request")
    loras.add_argument("--max-lora-rank", type=int, default=64, metavar="R", help="largest adapter rank accepted")
    loras.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                       help="adapters kept in host memory; least recently used unused ones are dropped beyond it "
                            "and reload when named (default: 4 x --max-loras)")
    # ---- memory: offload, admission by memory, sleep pool (diffserve.entrypoints.memory_options)
    from diffserve.entrypoints.memory_options import add_memory_arguments

    add_memory_arguments(parser)
    # ---- quantized weights, GGUF transformers (diffserve.entrypoints.quantization_options)
    from diffserve.entrypoints.quantization_options import add_quantization_arguments

    add_quantization_arguments(parser)


def _padding_ratio(text: str) -> float | str:
    """``--max-padding-ratio``: ``auto`` or a number (the range is checked by
    `check_engine_arguments`, naming the field)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: a number in [0, 1] or 'auto'") from None


def add_download_arguments(parser: argparse.ArgumentParser) -> None:
    """Where and which weights of a Hub id are fetched (engine commands and ``download``)."""
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="cache folder for Hub ids (default: the Hugging Face cache, HF_HUB_CACHE or "
                             "~/.cache/huggingface/hub)")
    parser.add_argument("--variant", default=None, metavar="NAME",
                        help="weights variant to fetch and load, e.g. fp16 (*.fp16.safetensors) (default: the "
                             "variant-less weights)")


def engine_config_from_args(args: argparse.Namespace):
    """Build an `EngineConfig` from parsed engine arguments (imports torch).

    Raises:
        InvalidRequestError: an invalid engine option (field names as in `EngineConfig`).
    """
    from diffserve.config import EngineConfig
    from diffserve.entrypoints.memory_options import memory_config
    from diffserve.entrypoints.quantization_options import quantization_config

    return EngineConfig(
        model=args.model,
        download_dir=args.download_dir,
        variant=args.variant,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        max_batch_size=args.max_batch_size,
        execution_mode=args.execution_mode,
        scheduling_policy=args.scheduling_policy,
        aging_s=args.aging_s,
        max_padding_ratio=args.max_padding_ratio,
        admission=args.admission,
        max_num_inference_steps=args.max_num_inference_steps,
        max_num_frames=args.max_num_frames,
        max_num_chunks=args.max_num_chunks,
        num_threads=args.threads,
        prompt_embed_cache_size=args.prompt_embed_cache_size,
        context_folding=args.context_folding,
        mixed_sizes=args.mixed_sizes,
        length_groups=args.length_groups,
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
        loras=lora_loads(getattr(args, "lora_loads", None)),
        lora_dir=args.lora_dir,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        **memory_config(args),
        **quantization_config(args),
    )


def lora_loads(values: list[str] | None) -> dict[str, str]:
    """``serve --lora NAME=PATH`` options as ``{name: path}``.

    Raises:
        InvalidRequestError: (field ``lora_loads``) a value without ``=``, an empty name or
            path, or a name given twice.
    """
    loads: dict[str, str] = {}
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError("lora_loads", value, "NAME=PATH (a name requests use, a LoRA file or folder)")
        if name in loads:
            raise InvalidRequestError("lora_loads", value, "each NAME once")
        loads[name] = path
    return loads


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
    if args.max_padding_ratio != "auto" and not 0 <= args.max_padding_ratio <= 1:  # NaN fails too
        raise InvalidRequestError("max_padding_ratio", args.max_padding_ratio,
                                  "a number in [0, 1] (1 = no cap) or 'auto'")
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
    for name in ("cfg_parallel_size", "ulysses_degree", "prompt_embed_cache_bytes", "max_loras", "max_lora_rank"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(name, getattr(args, name), "an integer >= 1")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise InvalidRequestError("max_cpu_loras", args.max_cpu_loras, f"an integer >= --max-loras ({args.max_loras})")
    if args.lora_dir is not None:
        if not Path(args.lora_dir).is_dir():
            raise InvalidRequestError("lora_dir", args.lora_dir, "an existing folder")
    for name, path in lora_loads(getattr(args, "lora_loads", None)).items():
        if not Path(path).exists():  # found now, not after the server started and the model loaded
            raise InvalidRequestError("lora_loads", f"{name}={path}", "NAME=PATH of an existing LoRA file or folder",
                                      detail=f"no such file or folder: {path}")
    from diffserve.core.memory_size import parse_memory  # torch-free

    parse_memory(getattr(args, "max_memory", None))
    from diffserve.entrypoints.quantization_options import check_quantization_arguments

    check_quantization_arguments(args)
