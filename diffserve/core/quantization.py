"""What a user asks for: quantization methods per component, the layers kept in full
precision, a single-file transformer. Torch-free, so the CLI checks its flags before importing
torch; the torch side is `diffserve.quantization.methods` / `.apply` / `.skip_search` / `.gguf`.

Methods (all through torchao, https://github.com/pytorch/ao; the weights of every
``torch.nn.Linear`` of a component are replaced by torchao tensor subclasses):

| method | torchao config | devices | what it buys |
| --- | --- | --- | --- |
| ``int8_weight_only`` | ``Int8WeightOnlyConfig`` (per-row int8 weights) | CPU, CUDA | ~0.27x weight bytes; on CPU no speed (the weights are dequantized per matmul) |
| ``int8_dynamic`` | ``Int8DynamicActivationInt8WeightConfig`` (W8A8, per-token activations) | CPU, CUDA | ~0.27x weight bytes and int8 matmuls |
| ``float8`` | ``Float8DynamicActivationFloat8WeightConfig`` (per-row, dynamic activations) | CUDA, compute capability >= 8.9 | ~0.5x of bf16 weight bytes, fp8 tensor-core matmuls |
| ``int4_weight_only`` | ``Int4WeightOnlyConfig`` (group 128, tinygemm layout) | CUDA, bf16 | ~0.28x of bf16 weight bytes |
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diffserve.core.errors import InvalidRequestError


@dataclass(frozen=True)
class Method:
    """One quantization method.

    Attributes:
        name: the name users write (``--quantization``).
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        min_cuda_capability: the oldest CUDA compute capability it runs on (major, minor).
        dtypes: model dtypes it runs with, torch names (``"bfloat16"``; None = any).
        summary: one line for help texts and errors.
    """

    name: str
    devices: tuple[str, ...]
    min_cuda_capability: tuple[int, int] = (0, 0)
    dtypes: tuple[str, ...] | None = None
    summary: str = ""


#: Every method, by name (see the module docstring).
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("int8_weight_only", ("cpu", "cuda"), summary="int8 weights, activations in the model dtype"),
    Method("int8_dynamic", ("cpu", "cuda"), summary="int8 weights and per-token dynamic int8 activations (W8A8)"),
    Method("float8", ("cuda",), (8, 9), summary="float8 weights and dynamic float8 activations (GPUs with FP8: "
           "compute capability >= 8.9)"),
    Method("int4_weight_only", ("cuda",), dtypes=("bfloat16",),
           summary="int4 weights in groups of 128 (CUDA, bf16)"),
)}
#: Words meaning "leave this component unquantized" in a per-component mapping.
NONE_WORDS = ("none", "null")
#: Components a single method applies to when no mapping is given: the denoisers and the text
#: encoders of the folder (the VAE is convolutional: quantizing its few linear layers saves
#: nothing and costs image quality; name it in a mapping to quantize it anyway).
DEFAULT_COMPONENT_PREFIXES = ("transformer", "unet", "text_encoder")
#: Components whose output error the automatic skip list measures (the denoisers).
DENOISER_PREFIXES = ("transformer", "unet")
#: Default budget of the automatic skip list: relative L2 error of the denoiser's output.
DEFAULT_ERROR_BUDGET = 0.03
#: ``--quantization-skip`` value that asks for the automatic search.
AUTO = "auto"

_METHOD_LIST = ", ".join(METHODS)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: A skip pattern: name characters, ``*`` ``?``, and closed ``[...]`` / ``[!...]`` sets (an
#: unclosed ``[`` would match a literal bracket, which no layer name has).
_PATTERN = re.compile(r"^(?:[A-Za-z0-9_.*?-]|\[!?[A-Za-z0-9_.-]+\])+$")


def _method_name(value: Any, allow_none: bool, component: str | None = None) -> str | None:
    """A method name (or None for a ``none`` entry) checked against `METHODS`.

    Raises:
        InvalidRequestError: field ``quantization``, listing the allowed values (and naming
            the `component` of a mapping).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        name = value.strip().lower().replace("-", "_")
        if allow_none and name in NONE_WORDS:
            return None
        if name in METHODS:
            return name
    allowed = f"one of {_METHOD_LIST}" + (" or none" if allow_none else "")
    raise InvalidRequestError("quantization", value, allowed,
                              f"for component {component!r}" if component is not None else None)


def parse_methods(value: Any) -> str | dict[str, str | None] | None:
    """``EngineConfig.quantization`` / ``--quantization``: one method for every quantizable
    component, or a per-component mapping.

    Accepted forms: None / ``"none"`` (off); a method name; a mapping ``{component: method or
    None}``; its JSON text (``'{"transformer": "int8_dynamic", "vae": null}'``); or
    ``"component=method,component=method"``.

    Returns:
        None, a method name, or {component: method name or None}.

    Raises:
        InvalidRequestError: field ``quantization``: an unknown method (the message lists the
            methods), a malformed mapping, or a component name that is not an identifier.
            Whether the components exist is checked against the folder (`check_components`).
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in NONE_WORDS or text == "":
            return None
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError("quantization", value, "a method name, a JSON object "
                                          "{component: method or null}, or component=method,...",
                                          f"not valid JSON: {exc.msg}") from None
        elif "=" in text:
            pairs = [p.partition("=") for p in text.split(",") if p.strip()]
            if any(not sep for _, sep, _ in pairs):
                raise InvalidRequestError("quantization", value, "component=method pairs separated by commas")
            if len({k.strip() for k, _, _ in pairs}) < len(pairs):
                raise InvalidRequestError("quantization", value, "component=method pairs naming each component once")
            value = {k.strip(): v.strip() for k, _, v in pairs}
        else:
            return _method_name(text, allow_none=False)
    if not isinstance(value, Mapping):
        raise InvalidRequestError("quantization", value, f"a method name ({_METHOD_LIST}), a mapping "
                                  "{component: method or none}, or none")
    out: dict[str, str | None] = {}
    for component, method in value.items():
        if not isinstance(component, str) or not _NAME.match(component):
            raise InvalidRequestError("quantization", component, "component names of the model folder "
                                      "(model_index.json keys such as transformer, text_encoder, vae)")
        out[component] = _method_name(method, allow_none=True, component=component)
    return out


def parse_skip(value: Any) -> str | tuple[str, ...] | None:
    """``EngineConfig.quantization_skip`` / ``--quantization-skip``: ``"auto"`` (the automatic
    search), layer-name patterns kept in full precision (a list, or one comma-separated
    string; shell-style wildcards ``*`` ``?`` ``[]``, matched against ``component.layer`` and
    against the bare layer name, e.g. ``*.ff.net.2`` or ``transformer.proj_out``), or None.

    Raises:
        InvalidRequestError: field ``quantization_skip``.
    """
    allowed = "'auto', layer-name patterns (comma-separated, wildcards * ? [...], e.g. '*.ff.net.2'), or none"
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        if text.lower() in NONE_WORDS:
            return None
        if not text:  # an empty value is a mistake, not "none": say none
            raise InvalidRequestError("quantization_skip", value, allowed)
        value = text.split(",")
    if isinstance(value, (list, tuple)) and value and all(isinstance(p, str) for p in value):
        patterns = tuple(p.strip() for p in value)
        for p in patterns:
            if not p:
                raise InvalidRequestError("quantization_skip", ",".join(patterns), allowed, detail="an empty pattern")
            if not _PATTERN.match(p):
                raise InvalidRequestError("quantization_skip", p, allowed)
        return patterns
    raise InvalidRequestError("quantization_skip", value, allowed)


def parse_budget(value: Any) -> float:
    """``EngineConfig.quantization_error_budget``: the automatic skip list's bound on the
    denoiser output's relative L2 error (a fraction, 0 < budget < 1).

    Raises:
        InvalidRequestError: field ``quantization_error_budget``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value < 1:
        raise InvalidRequestError("quantization_error_budget", value,
                                  "a fraction in (0, 1): the denoiser output's relative L2 error")
    return float(value)


def parse_transformer_file(value: Any) -> str | None:
    """``EngineConfig.transformer_file`` / ``--transformer-file``: a GGUF single-file
    transformer (``*.gguf``) that replaces the folder's denoiser weights.

    Raises:
        InvalidRequestError: field ``transformer_file``: not a path ending in ``.gguf``.
    """
    if value is None:
        return None
    import os

    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.lower().endswith(".gguf"):
        raise InvalidRequestError("transformer_file", value, "a path to a GGUF single-file transformer (*.gguf)")
    return value


@dataclass(frozen=True)
class QuantizationSpec:
    """The parsed quantization settings of an engine.

    Attributes:
        methods: None (no torchao quantization), one method name for every quantizable
            component, or {component: method or None}.
        skip: ``"auto"``, layer-name patterns kept in full precision, or None.
        error_budget: the automatic search's bound on the denoiser output's relative L2 error.
        transformer_file: a GGUF single-file transformer, or None.
    """

    methods: str | dict[str, str | None] | None = None
    skip: str | tuple[str, ...] | None = None
    error_budget: float = DEFAULT_ERROR_BUDGET
    transformer_file: str | None = None

    @classmethod
    def parse(cls, methods: Any = None, skip: Any = None, error_budget: Any = DEFAULT_ERROR_BUDGET,
              transformer_file: Any = None) -> "QuantizationSpec":
        """Parse and cross-check the four settings (see the `parse_*` functions).

        Raises:
            InvalidRequestError: naming the offending field; a skip list without a method
                (field ``quantization_skip``).
        """
        spec = cls(parse_methods(methods), parse_skip(skip), parse_budget(error_budget),
                   parse_transformer_file(transformer_file))
        if spec.skip is not None and not spec.enabled_methods():
            raise InvalidRequestError("quantization_skip", skip, "none unless quantization names a method")
        return spec

    def enabled_methods(self) -> set[str]:
        """The method names in use."""
        if self.methods is None:
            return set()
        if isinstance(self.methods, str):
            return {self.methods}
        return {m for m in self.methods.values() if m is not None}

    def component_methods(self, components: Iterable[str]) -> dict[str, str]:
        """{component: method} for the given quantizable components of a folder (modules
        with weights): a single method applies to the denoisers and text encoders
        (`DEFAULT_COMPONENT_PREFIXES`); a mapping applies as written.

        Raises:
            InvalidRequestError: field ``quantization``: the mapping names a component the
                folder does not have (the message lists the folder's components).
        """
        components = list(components)
        if self.methods is None:
            return {}
        if isinstance(self.methods, str):
            return {c: self.methods for c in components if c.startswith(DEFAULT_COMPONENT_PREFIXES)}
        check_components(self.methods, components)
        return {c: m for c, m in self.methods.items() if m is not None}

    def as_dict(self) -> dict[str, Any]:
        """Plain data for logs and ``/v1/models``."""
        return {"methods": self.methods, "skip": list(self.skip) if isinstance(self.skip, tuple) else self.skip,
                "error_budget": self.error_budget, "transformer_file": self.transformer_file}


def check_components(methods: Mapping[str, Any], components: Iterable[str]) -> None:
    """Check that every component of a per-component mapping is a quantizable component.

    Raises:
        InvalidRequestError: field ``quantization``, listing the allowed component names.
    """
    components = list(components)
    for name in methods:
        if name not in components:
            raise InvalidRequestError("quantization", name, "a component of this model: " + ", ".join(components))


def check_device(spec: QuantizationSpec, device_type: str, dtype: str,
                 cuda_capability: tuple[int, int] | None = None) -> None:
    """Refuse, at start, a method the device cannot run.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: the model dtype's torch name (``float32``, ``bfloat16``, ``float16``).
        cuda_capability: the CUDA device's compute capability (major, minor).

    Raises:
        InvalidRequestError: field ``quantization``: the method does not run on this device or
            with this dtype; the message says what it needs and which methods run here.
    """
    for name in sorted(spec.enabled_methods()):
        method = METHODS[name]
        here = [m.name for m in METHODS.values() if device_type in m.devices]
        if device_type not in method.devices:
            raise InvalidRequestError("quantization", name, f"one of {', '.join(here)} on a {device_type} device",
                                      f"{name} needs a {'/'.join(method.devices)} device")
        if device_type == "cuda" and cuda_capability is not None and cuda_capability < method.min_cuda_capability:
            need = ".".join(map(str, method.min_cuda_capability))
            have = ".".join(map(str, cuda_capability))
            raise InvalidRequestError("quantization", name, f"a method this GPU runs (compute capability {have})",
                                      f"{name} needs compute capability >= {need}")
        if method.dtypes is not None and dtype not in method.dtypes:
            raise InvalidRequestError("quantization", name, f"used with dtype {method.dtypes[0]}",
                                      f"the model dtype is {dtype}")


@dataclass
class ComponentReport:
    """How one component was quantized (plain data: logs, stats, ``/v1/models``).

    Attributes:
        method: the method name, ``"torchao:<Config>"`` for a pre-quantized folder, or
            ``"gguf:<types>"`` for a GGUF file.
        source: ``"quantized at load"``, ``"pre-quantized folder"`` or ``"gguf file"``.
        quantized_layers: linear layers and embedding tables holding quantized weights.
        kept_layers: linear layers kept in full precision (qualified ``component.layer``).
        bytes: the component's weight bytes now (real storage of the tensor subclasses).
        full_precision_bytes: the same weights in the model dtype.
        error: the denoiser output's relative L2 error measured by the automatic search (None
            when not measured).
    """

    method: str
    source: str
    quantized_layers: int = 0
    kept_layers: list[str] = field(default_factory=list)
    bytes: int = 0
    full_precision_bytes: int = 0
    error: float | None = None

    @property
    def ratio(self) -> float | None:
        """bytes / full_precision_bytes."""
        return self.bytes / self.full_precision_bytes if self.full_precision_bytes else None

    def as_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "source": self.source, "quantized_layers": self.quantized_layers,
               "kept_layers": list(self.kept_layers), "bytes": self.bytes,
               "full_precision_bytes": self.full_precision_bytes}
        if self.full_precision_bytes:
            out["ratio"] = round(self.bytes / self.full_precision_bytes, 4)
        if self.error is not None:
            out["error"] = round(self.error, 6)
        return out
