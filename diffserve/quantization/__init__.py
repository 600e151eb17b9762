"""Quantized weights: torchao methods per component, pre-quantized folders, GGUF single-file
transformers, and the automatic list of layers kept in full precision.

One concept per module:

- `spec` (torch-free): the methods, parsing and checking ``EngineConfig.quantization`` /
  ``quantization_skip`` / ``quantization_error_budget`` / ``transformer_file``, the device
  refusals, and the per-component report (plain data for stats and ``/v1/models``);
- `methods`: each method's torchao config;
- `apply`: quantizing a component's linear layers (torchao ``quantize_``), describing a
  component that arrived quantized (a pre-quantized folder, a GGUF file);
- `skip_search`: the automatic skip list (calibration inputs, per-layer sensitivity, the
  fewest layers kept within an error budget);
- `gguf`: loading a GGUF single-file transformer through diffusers;
- `plan`: what was decided at load (methods and kept layers per component), re-applied when
  sleeping weights are reloaded from the folder.

The runner calls into this package after loading and before compile and offload; the package
never imports the runner, executor, engine or entrypoints.
"""

from diffserve.quantization.spec import (
    AUTO,
    DEFAULT_ERROR_BUDGET,
    METHODS,
    ComponentReport,
    QuantizationSpec,
    check_device,
)

__all__ = ["AUTO", "DEFAULT_ERROR_BUDGET", "METHODS", "ComponentReport", "QuantizationSpec", "check_device"]
