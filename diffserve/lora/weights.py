"""`LoraAdapter`: one LoRA adapter as plain per-module low-rank factors, whatever file format it
came from (see `diffserve.lora.reading`).

A module's update is ``delta(x) = scaling * (B(A(x)) + bias)``: for an ``nn.Linear``
``A`` (r, in) and ``B`` (out, r); for an ``nn.ConvNd`` ``A`` is a conv (r, in, *kernel) with the
base layer's stride and padding and ``B`` a 1x1 conv (out, r, 1, ...), as PEFT builds them.
``scaling`` is PEFT's: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), which is what
diffusers' ``set_adapters`` multiplies by the request's weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraModule:
    """The low-rank factors of one adapted module.

    Attributes:
        a: ``A``: (r, in) for a linear module, (r, in, *kernel) for a conv.
        b: ``B``: (out, r) for a linear module, (out, r, 1, ...) for a conv.
        scaling: PEFT's per-module scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
        bias: (out,) ``lora_B`` bias (PEFT ``lora_bias=True``), or None.
        stride / padding: ``A``'s conv stride and padding (the base conv's); None for linear.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None
    stride: tuple[int, ...] | None = None
    padding: tuple[int, ...] | str | None = None

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    @property
    def is_conv(self) -> bool:
        return self.a.dim() > 2

    @property
    def nbytes(self) -> int:
        tensors = [self.a, self.b] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class LoraAdapter:
    """One adapter, read and checked against the loaded model.

    Attributes:
        name: the name requests use (``SamplingParams.loras`` keys).
        source: where it was read from (a path, for messages and reloads).
        modules: ``{component: {module path: LoraModule}}``; components are the pipeline's
            names (``"transformer"``, ``"unet"``, ``"text_encoder"``, ...), module paths
            ``named_modules()`` names inside them.
        format: what the file looked like (``"diffusers"``, ``"peft"``, ``"kohya"``,
            ``"non-diffusers"``), for listings.
    """

    name: str
    source: str
    modules: dict[str, dict[str, LoraModule]] = field(default_factory=dict)
    format: str = "diffusers"

    @property
    def components(self) -> list[str]:
        """Components the adapter changes, in a stable order."""
        return sorted(c for c, mods in self.modules.items() if mods)

    @property
    def rank(self) -> int:
        """The largest rank of any module (0 for an empty adapter)."""
        return max((m.rank for mods in self.modules.values() for m in mods.values()), default=0)

    @property
    def num_modules(self) -> int:
        return sum(len(mods) for mods in self.modules.values())

    @property
    def nbytes(self) -> int:
        """Bytes of its factors."""
        return sum(m.nbytes for mods in self.modules.values() for m in mods.values())

    def info(self) -> dict:
        """Plain-data summary (names, rank, modules per component, bytes, format)."""
        return {"name": self.name, "source": self.source, "format": self.format, "rank": self.rank,
                "modules": {c: len(self.modules[c]) for c in self.components}, "bytes": self.nbytes}
