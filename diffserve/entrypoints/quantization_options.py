"""Command-line options for quantized weights (torch-free: checked before torch loads).

Engine options (``generate``, ``edit`` and ``serve``)::

    --quantization SPEC              a method for every denoiser and text encoder
                                     (int8_weight_only, int8_dynamic; CUDA: float8,
                                     int4_weight_only), or per component:
                                     transformer=int8_dynamic,text_encoder=none or JSON
    --quantization-skip auto|PATTERNS
                                     layers kept in full precision: chosen at load (auto),
                                     or layer-name patterns (comma-separated, wildcards)
    --quantization-error-budget F    auto's bound on the denoiser output's relative error
    --transformer-file FILE.gguf     a GGUF single-file transformer instead of the folder's

See `diffserve.core.quantization` and `diffserve.quantization`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from diffserve.core.errors import InvalidRequestError
from diffserve.core.quantization import DEFAULT_ERROR_BUDGET, METHODS, QuantizationSpec


def add_quantization_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine's quantization options to `parser`."""
    group = parser.add_argument_group("quantization")
    group.add_argument("--quantization", default=None, metavar="SPEC",
                       help=f"quantized weights through torchao: one of {', '.join(METHODS)} for every denoiser and "
                            "text encoder, or per component, e.g. transformer=int8_dynamic,text_encoder=none (or a "
                            "JSON object); float8 and int4_weight_only need a CUDA GPU")
    group.add_argument("--quantization-skip", default=None, metavar="auto|PATTERNS",
                       help="linear layers kept in full precision: auto (the fewest that keep the denoiser's "
                            "output error within --quantization-error-budget, measured at load), or layer-name "
                            "patterns, comma-separated, with wildcards (e.g. '*.ff.net.2,transformer.proj_out')")
    group.add_argument("--quantization-error-budget", type=float, default=DEFAULT_ERROR_BUDGET, metavar="F",
                       help="with --quantization-skip auto: the bound on the denoiser output's relative L2 error "
                            f"(default {DEFAULT_ERROR_BUDGET})")
    group.add_argument("--transformer-file", default=None, metavar="FILE.gguf",
                       help="a GGUF single-file transformer loaded instead of the folder's (through diffusers' GGUF "
                            "support; dequantized on the fly); the folder gives its config and the other components")


def quantization_config(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields of the quantization options in `args`."""
    return {"quantization": args.quantization, "quantization_skip": args.quantization_skip,
            "quantization_error_budget": args.quantization_error_budget, "transformer_file": args.transformer_file}


def check_quantization_arguments(args: argparse.Namespace) -> None:
    """The torch-free checks (methods, components' syntax, skip patterns, budget, that the
    transformer file exists; a GPU-only method with ``--device cpu``).

    Raises:
        InvalidRequestError: naming the option's field.
    """
    from diffserve.core.quantization import check_device

    spec = QuantizationSpec.parse(args.quantization, args.quantization_skip, args.quantization_error_budget,
                                  args.transformer_file)
    if spec.transformer_file is not None:
        if not Path(spec.transformer_file).is_file():  # found before torch and the model load
            raise InvalidRequestError("transformer_file", spec.transformer_file, "an existing GGUF single-file "
                                      "transformer (*.gguf)", detail="no such file")
    if getattr(args, "device", None) == "cpu":
        check_device(spec, "cpu", "float32")
