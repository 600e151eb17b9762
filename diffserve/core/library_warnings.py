"""Hide diffusers/transformers warnings that do not apply to how diffserve runs models.

- diffusers' ``Pipelines loaded with dtype=torch.float16 cannot run with cpu device``: torch
  runs float16 on CPU (slowly, but correctly), and diffserve never moves whole pipelines; the
  message repeats once per component.
- transformers' ``XImageProcessor requires torchvision (not installed); falling back to
  XImageProcessorPil``: diffserve installs no torchvision (its PyPI build does not import beside
  the CPU torch), and the PIL image processors are what its image-input families use.
- diffusers' ``There are modules in X that should be kept in float32: []. Casting directly with
  `to()` can lead to inconsistent results``: printed for every model cast to a dtype (the dummy
  load format builds models, then casts them) even when the list is empty; only the empty-list
  form is dropped (a model with float32 modules still warns).
- diffusers' ``No LoRA keys associated to X found with the prefix=...``: printed for every
  LoRA-loadable component a LoRA file does not touch (most files change only the denoiser);
  diffserve's LoRA reader counts matched and unmatched modules itself and refuses a file that
  does not match (`diffserve.lora.reading`).
- transformers' ``Token indices sequence length is longer than the specified maximum sequence
  length for this model (...). Running this sequence through the model will result in indexing
  errors``: diffserve tokenizes a prompt once without truncation only to tell whether it is
  too long, then encodes it truncated (no indexing error happens) and prints its own one-line
  truncation warning with the limit.
- torchao's import-time ``Failed to load .../_C_mxfp8...so`` / ``_C_cutlass_90a`` (kernel
  libraries for mxfp8 and Hopper CUTLASS paths, which diffserve's methods do not use; they cannot
  load without CUDA) and ``Detected no triton`` (Triton kernels are GPU-only); transformers
  imports torchao whenever it is installed, so these showed on every run.
- diffusers' ``Unable to import `torchao` Tensor objects`` (it registers pickle globals of
  tensor classes that torchao 0.18 no longer has; pre-quantized folders load from safetensors)
  and ``You are trying to set torch_dtype to torch.float32 for integer quantization, but only
  bfloat16 is supported`` (int8 runs in float32 on CPU; diffserve's CPU default).
- torch's ``<enum 'KernelPreference'> is an Enum subclass and is now natively supported by
  torch.compile ...`` (torchao registers its enums the older way when it is imported: a
  deprecation notice for torchao, nothing a user can act on).

Only these messages are dropped (logger filters on the exact loggers that emit them), so every
other library warning still shows. Installing the filters imports neither library; the loader
installs them before it imports either, so library users get them too.
"""

from __future__ import annotations

import logging

#: (logger name, text identifying a message that does not apply).
INAPPLICABLE_WARNINGS: tuple[tuple[str, str], ...] = (
    ("diffusers.pipelines.pipeline_utils", "cannot run with `cpu` device"),
    ("diffusers.modular_pipelines.modular_pipeline", "cannot run with `cpu` device"),
    ("transformers.utils.import_utils", "requires torchvision (not installed)"),
    ("diffusers.models.modeling_utils", "that should be kept in float32: []."),
    ("transformers.tokenization_utils_base", "Token indices sequence length is longer than the specified maximum"),
    ("torchao", "Failed to load"),
    ("torchao.kernel.intmm", "Detected no triton"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "for integer quantization, but only bfloat16 is supported"),
    ("diffusers.loaders.lora_base", "No LoRA keys associated to"),
    ("diffusers.loaders.peft", "No LoRA keys associated to"),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported by torch.compile"),
)


class _DropMessages(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def silence_inapplicable_library_warnings() -> None:
    """Install the filters (idempotent)."""
    for name, fragment in INAPPLICABLE_WARNINGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(_DropMessages(fragment))
