"""Offline tokenizers of real models' classes and vocabulary sizes, for the weightless config
folders (`*_config_folder.py`) that benchmark an architecture with ``--load-format dummy``.

The real tokenizers cannot be downloaded here. These have the right class and vocabulary size
(so the text encoders' embedding tables have their real shapes) and tokenize plain prompts
sensibly; their token ids mean nothing to real weights, which dummy loading does not read.
"""

from __future__ import annotations

import json

from transformers import CLIPTokenizer, T5Tokenizer

from diffserve.models.digits.tokenizer import build_clip_tokenizer

#: CLIP ViT-L/14 and OpenCLIP bigG vocabularies.
CLIP_VOCAB_SIZE = 49408


def clip_tokenizer(vocab_size: int = CLIP_VOCAB_SIZE) -> CLIPTokenizer:
    """The package's byte-level CLIP tokenizer with its vocabulary filled up to ``vocab_size``
    entries (``<|unused_N|>``: no merge produces them, so tokenization is unchanged)."""
    small = build_clip_tokenizer(model_max_length=77)
    model = json.loads(small.backend_tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(len(vocab), vocab_size):
        vocab[f"<|unused_{i}|>"] = i
    return CLIPTokenizer(vocab=vocab, merges=[tuple(m) for m in model["merges"]], model_max_length=77)


def t5_tokenizer(pieces: int, extra_ids: int) -> T5Tokenizer:
    """A character unigram T5 / UMT5 tokenizer (pad 0, eos 1, unk 2) with ``pieces`` pieces --
    filler pieces of two private-use characters, which prompts never contain -- plus
    ``extra_ids`` sentinel tokens (T5 v1.1: 32000 + 100; UMT5: 256000 + 300)."""
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-":
        vocab += [(c, -3.0), ("▁" + c, -3.5)]
    for i in range(pieces - len(vocab)):
        vocab.append((chr(0xE000 + i // 6400) + chr(0xE000 + i % 6400), -30.0))
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=extra_ids)
    tokenizer.model_max_length = 512
    return tokenizer
