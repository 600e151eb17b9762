"""Parsing and checking the quantization settings (torch-free part): one-line errors naming the
field and listing the allowed values, refusals of GPU-only methods on a CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diffserve.core.errors import InvalidRequestError
from diffserve.core.quantization import (
    METHODS,
    QuantizationSpec,
    check_device,
    parse_budget,
    parse_methods,
    parse_skip,
    parse_transformer_file,
)


def test_methods_parse_every_form():
    assert parse_methods(None) is None and parse_methods("none") is None
    assert parse_methods("int8_dynamic") == "int8_dynamic"
    assert parse_methods("INT8-Weight-Only") == "int8_weight_only"
    mapping = {"transformer": "int8_weight_only", "text_encoder": "int8_dynamic", "vae": None}
    assert parse_methods(mapping) == mapping
    assert parse_methods('{"transformer": "int8_weight_only", "text_encoder": "int8_dynamic", "vae": null}') == mapping
    assert parse_methods("transformer=int8_weight_only, text_encoder=int8_dynamic,vae=none") == mapping


@pytest.mark.parametrize("value, component", [
    ("int3", None),
    ({"transformer": "fp4"}, "transformer"),
    ("transformer=int8", "transformer"),
    ({"trans former": "int8_dynamic"}, None),
    ("{not json", None),
    (7, None),
    ("transformer=int8_dynamic,transformer=none", None),  # was: the last one silently won
])
def test_bad_method_is_one_line_naming_field_and_allowed(value, component):
    with pytest.raises(InvalidRequestError) as info:
        parse_methods(value)
    message = str(info.value)
    assert info.value.field == "quantization" and "\n" not in message
    if component is not None or value == "int3":
        assert all(name in message for name in METHODS)
    if component is not None:
        assert f"for component {component!r}" in message


def test_unknown_component_lists_the_folders_components():
    spec = QuantizationSpec.parse({"transfomer": "int8_dynamic"})
    with pytest.raises(InvalidRequestError) as info:
        spec.component_methods(["transformer", "text_encoder", "vae"])
    assert info.value.field == "quantization" and "'transfomer'" in str(info.value)
    assert "transformer, text_encoder, vae" in str(info.value) and "\n" not in str(info.value)


def test_single_method_applies_to_denoisers_and_text_encoders():
    spec = QuantizationSpec.parse("int8_dynamic")
    assert spec.component_methods(["transformer", "transformer_2", "text_encoder", "text_encoder_3", "vae"]) == {
        "transformer": "int8_dynamic", "transformer_2": "int8_dynamic", "text_encoder": "int8_dynamic",
        "text_encoder_3": "int8_dynamic"}
    mapped = QuantizationSpec.parse({"vae": "int8_weight_only", "transformer": None})
    assert mapped.component_methods(["transformer", "vae"]) == {"vae": "int8_weight_only"}


def test_skip_budget_and_file():
    assert parse_skip("auto") == "auto" and parse_skip(None) is None and parse_skip("none") is None
    assert parse_skip("*.ff.net.2, proj_out") == ("*.ff.net.2", "proj_out")
    assert parse_skip(["transformer.proj_out"]) == ("transformer.proj_out",)
    assert parse_skip("transformer_blocks.[0-3].ff, *.[!a]") == ("transformer_blocks.[0-3].ff", "*.[!a]")
    for bad in ("a b", [1], [], "", " ", "[", "a[0", "[]", "x]", "a,,b", "a,", ["a", ""]):
        with pytest.raises(InvalidRequestError, match="quantization_skip"):
            parse_skip(bad)
    assert parse_budget(0.05) == 0.05
    for bad in (0, 1, -0.1, float("nan"), "0.1", True):
        with pytest.raises(InvalidRequestError, match="quantization_error_budget"):
            parse_budget(bad)
    assert parse_transformer_file("x/model.GGUF") == "x/model.GGUF"
    with pytest.raises(InvalidRequestError, match="transformer_file.*gguf"):
        parse_transformer_file("model.safetensors")
    with pytest.raises(InvalidRequestError, match="quantization_skip"):
        QuantizationSpec.parse(None, skip="auto")


@pytest.mark.parametrize("method", ["float8", "int4_weight_only"])
def test_gpu_methods_refused_on_cpu(method):
    spec = QuantizationSpec.parse({"transformer": method})
    with pytest.raises(InvalidRequestError) as info:
        check_device(spec, "cpu", "float32")
    message = str(info.value)
    assert info.value.field == "quantization" and "cuda" in message and "int8_dynamic" in message
    assert "\n" not in message


def test_cuda_capability_and_dtype_refusals():
    with pytest.raises(InvalidRequestError, match="compute capability >= 8.9"):
        check_device(QuantizationSpec.parse("float8"), "cuda", "bfloat16", (8, 0))
    check_device(QuantizationSpec.parse("float8"), "cuda", "bfloat16", (9, 0))
    with pytest.raises(InvalidRequestError, match="bfloat16"):
        check_device(QuantizationSpec.parse("int4_weight_only"), "cuda", "float16", (9, 0))
    check_device(QuantizationSpec.parse("int8_dynamic"), "cpu", "float32")


def test_spec_module_imports_no_torch():
    code = ("import sys; import diffserve.core.quantization, diffserve.quantization; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
