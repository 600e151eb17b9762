"""Quantized weights: torchao methods per component, pre-quantized folders, GGUF single-file
transformers, and the automatic list of layers kept in full precision.

What a user asks for (methods, per-component mapping, skip list, error budget, GGUF file) and
the per-component report are plain data in `diffserve.core.quantization` (torch-free: the
config and the CLI check them before torch loads). This package does the work, one concept per
module:

- `methods`: each method's torchao config;
- `embedding`: int8 token-embedding tables looked up row by row;
- `apply`: quantizing a component's linear layers (torchao ``quantize_``), describing a
  component that arrived quantized (a pre-quantized folder, a GGUF file);
- `skip_search`: the automatic skip list (calibration inputs, per-layer sensitivity, the
  fewest layers kept within an error budget);
- `gguf`: loading a GGUF single-file transformer through diffusers;
- `plan`: quantizing a loaded model's components as asked, and what was decided (methods and
  kept layers per component), re-applied when sleeping weights are reloaded from the folder.

The runner calls into this package after loading and before compile and offload; the package
never imports the runner, executor, engine or entrypoints.
"""
