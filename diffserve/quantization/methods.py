"""The torchao configuration of each method (`diffserve.core.quantization.METHODS`).

torchao (https://github.com/pytorch/ao) replaces a ``torch.nn.Linear``'s weight with a tensor
subclass holding the quantized data and its scales; ``F.linear`` on it runs the method's kernel
(int8 x int8 -> int32 matmul for ``int8_dynamic``, dequantize-then-matmul for
``int8_weight_only`` on CPU, fp8 tensor-core matmul for ``float8``, tinygemm for
``int4_weight_only``).

torchao's ``set_inductor_config`` is turned off: it changes inductor's process-wide settings
(coordinate-descent tuning) for every model in the process; diffserve leaves them as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from diffserve.core.errors import InvalidRequestError
from diffserve.core.quantization import METHODS

#: Methods that also store token-embedding tables as int8 (`diffserve.quantization.embedding`):
#: the int8 ones. float8 / int4 quantize linear layers only.
EMBEDDING_METHODS = ("int8_weight_only", "int8_dynamic")


def import_torchao() -> Any:
    """Import torchao.

    Raises:
        InvalidRequestError: field ``quantization``: torchao is not installed.
    """
    try:
        import torchao
        import torchao.quantization  # noqa: F401
    except ImportError as exc:
        raise InvalidRequestError("quantization", None, "unset, or install torchao: pip install 'diffserve[quantization]'",
                                  str(exc)) from exc
    return torchao


def torchao_config(method: str) -> Any:
    """The torchao ``AOBaseConfig`` of `method`.

    Raises:
        InvalidRequestError: field ``quantization``: unknown method.
    """
    import_torchao()
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if method == "int8_weight_only":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if method == "int8_dynamic":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if method == "float8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    if method == "int4_weight_only":
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        return Int4WeightOnlyConfig(group_size=128, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D,
                                    set_inductor_config=False)
    raise InvalidRequestError("quantization", method, "one of " + ", ".join(METHODS))


def can_quantize(module: torch.nn.Module, method: str) -> bool:
    """Whether `method` applies to a linear layer: int4 needs in_features divisible by its
    group size (128) and out_features by 8 (torchao leaves other shapes unquantized; so does
    diffserve, and reports them as kept)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    if method == "int4_weight_only":
        return module.in_features % 128 == 0 and module.out_features % 8 == 0
    if method == "float8":
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True
