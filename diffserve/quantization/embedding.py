"""Int8 token-embedding tables: one int8 row per token with one scale per row, looked up by
gathering the requested rows first and converting only those.

A text encoder's token-embedding table is a large share of its weights (CLIP-L: 49408 x 768,
31 % of its parameters; CLIP-G: 49408 x 1280), so quantizing only its linear layers leaves the
encoder at 0.32x-0.48x of its fp32 bytes. torchao 0.18 does quantize ``nn.Embedding`` weights
(``IntxWeightOnlyConfig``), but its lookup converts the WHOLE table back to floating point at
every call: measured 827 ms per lookup of a CLIP-L table at 2 x 77 tokens (fp32: 0.26 ms; CPU,
1 thread, a loaded 2-core machine). Here the table is quantized by torchao's own primitives
(``choose_qparams_affine`` / ``quantize_affine``: int8, symmetric, one block per row) and a
lookup gathers the int8 rows first, then converts only those (``q x scale``, what torchao's
``dequantize_affine`` computes for a zero point of 0).
"""

from __future__ import annotations

import torch

#: Tables with fewer rows stay as they are: position tables are small (CLIP: 77 rows, T5's
#: relative-position buckets: 32) and code reads their ``weight`` (transformers' CLIP reads
#: ``position_embedding.weight.shape`` at every forward). Token tables have hundreds of rows
#: (the built-in models: 626) to ~250 k.
MIN_ROWS = 256


class Int8Embedding(torch.nn.Module):
    """A ``torch.nn.Embedding`` whose table is int8 with one floating-point scale per row
    (symmetric per-row quantization, zero point 0).

    Buffers: ``qdata`` int8 ``(num_embeddings, embedding_dim)``, ``scale`` in the table's dtype
    ``(num_embeddings, 1)``. Storage: ``embedding_dim + itemsize`` bytes per row (0.25x of fp32
    plus the scales). Error: at most half a quantization step per element, i.e. a row's largest
    magnitude / 254.

    `forward` takes token ids (any integer shape ``S``) and returns ``S + (embedding_dim,)`` in
    the table's original dtype. ``weight`` converts the whole table (for code that reads it;
    `forward` never does).
    """

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, padding_idx: int | None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = qdata.shape
        self.padding_idx = padding_idx
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)

    @classmethod
    @torch.no_grad()
    def from_embedding(cls, embedding: torch.nn.Embedding) -> Int8Embedding:
        """Quantize `embedding`'s table with torchao's affine primitives (int8, symmetric, one
        block per row).

        Raises:
            ValueError: `embedding` renormalises rows (``max_norm``) or is sparse: those
                change the table at lookup time, which an int8 copy cannot follow.
        """
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError("an embedding with max_norm or sparse gradients cannot be quantized")
        from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

        table = embedding.weight.detach()
        block = (1, table.shape[1])
        scale, zero_point = choose_qparams_affine(table, MappingType.SYMMETRIC, block, torch.int8,
                                                  scale_dtype=table.dtype, zero_point_dtype=torch.int8)
        qdata = quantize_affine(table, block, scale, zero_point, torch.int8)
        return cls(qdata, scale.reshape(-1, 1).to(table.dtype), embedding.padding_idx)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.qdata[input_ids].to(self.scale.dtype) * self.scale[input_ids]

    @property
    def weight(self) -> torch.Tensor:
        """The whole table converted back, ``(num_embeddings, embedding_dim)`` (a full copy)."""
        return self.qdata.to(self.scale.dtype) * self.scale

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 per-row"


def quantize_embeddings(module: torch.nn.Module, skip: set[str] = frozenset()) -> list[str]:
    """Replace every ``torch.nn.Embedding`` of `module` with at least `MIN_ROWS` rows (token
    tables) by an `Int8Embedding`, except those named in `skip` (qualified names relative to
    `module`). A table reached under several names, one module or tied weights (T5's ``shared``
    and ``encoder.embed_tokens``), is quantized once and every name points at the int8 copy;
    skipping one of its names keeps it under all.

    Returns:
        The qualified names of the quantized tables (every name of a shared one).
    """
    tables = {name: m for name, m in module.named_modules(remove_duplicate=False)
              if isinstance(m, torch.nn.Embedding) and m.num_embeddings >= MIN_ROWS
              and m.max_norm is None and not m.sparse}
    skipped = {id(m.weight) for name, m in tables.items() if name in skip}  # every name of a kept table
    targets = {name: m for name, m in tables.items() if id(m.weight) not in skipped}
    made: dict[int, Int8Embedding] = {}
    for name, embedding in targets.items():
        key = id(embedding.weight)
        if key not in made:
            made[key] = Int8Embedding.from_embedding(embedding)
        parent_name, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent_name), child, made[key])
    return list(targets)
