"""Train the built-in ``digits-reasoning`` model: a tiny causal LM that answers arithmetic
prompts, and a DiT that draws the answer by reading the LM's per-layer K/V.

Run (about 10 minutes on one CPU thread)::

    python -m training.digits_reasoning.train --out diffserve/models/digits_reasoning/weights --seed 0

Phases, under one wall-clock budget:

1. **Language model** (`transformers.Qwen2ForCausalLM`, 4 layers, hidden 96, 3 heads of 32,
   no grouped KV; the word-level tokenizer of `tokenizer`): supervised on the training prompts
   of `grammar` formatted with the chat template, ``<bos> {prompt} = {answer} <eos>``, with
   the cross-entropy on the answer and EOS tokens only; AdamW, warm-up then cosine decay, full
   batch. Its held-out accuracy (greedy answers of the held-out prompts) is printed and put
   in the model card.
2. **DiT** (`SD3Transformer2DModel`, the digits architecture: 4 layers, 3 heads of 32, patch 2,
   whose block ``i`` reads the LM's layer-``i`` K/V through
   `diffserve.pipelines.digits_reasoning.ar_context_attention`): rectified flow (Esser et al.
   2024) on the built-in digits model's training images encoded by its VAE (reused frozen).
   Each image gets the K/V of a random training prompt whose answer is its digit, computed
   once per prompt by `diffserve.pipelines.ar_context.export_kv` over ``<bos> {prompt} =
   {answer} <eos>`` exactly as served; with probability 0.1 the K/V of the empty negative
   prompt (``<bos> =``) instead, for classifier-free guidance. The DiT's own text stream is a
   constant token, so the K/V are its only conditioning. AdamW, EMA
   (`training.common.train_denoiser`).

The result is a `DigitsReasoningPipeline` folder (`DigitsReasoningPipeline.from_pretrained`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from training import common as training
from diffserve.models.digits import DEFAULT_MODEL_PATH as DIGITS_MODEL_PATH
from training.digits import data as digits_data
from diffserve.pipelines.ar_context import export_kv, prompt_input_ids
from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline, pad_contexts
from training.digits_reasoning import grammar
from training.digits_reasoning.tokenizer import build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WEIGHTS_DIR = REPO_ROOT / "diffserve" / "models" / "digits_reasoning" / "weights"
PACKAGE_MODEL_CARD = DEFAULT_WEIGHTS_DIR.parent / "MODEL_CARD.md"
#: Sampling defaults shipped with the model (diffserve reads generation_config.json).
GENERATION_DEFAULTS = {"num_inference_steps": 20, "guidance_scale": 4.0, "height": 8, "width": 8}
#: The grammar as a markdown table (model card).
PROMPT_TABLE = """`X`, `Y`: number words `zero` .. `nine` or digits `0` .. `9`; every answer is a single digit.

| prompt | condition | answer |
|---|---|---|
| `X plus Y` | X + Y <= 9 | X + Y |
| `X minus Y` | X >= Y | X - Y |
| `the number after X` | X <= 8 | X + 1 |
| `the number before X` | X >= 1 | X - 1 |
| `half of X` | X even | X / 2 |
| `twice X` | X <= 4 | 2 X |"""
#: Longest answer the LM writes (answer word + EOS, with room to spare).
MAX_NEW_TOKENS = 4


@dataclass(frozen=True)
class ModelSize:
    """Architecture of the LM and the DiT (their layers, heads and head dim must match)."""

    layers: int = 4
    heads: int = 3
    head_dim: int = 32
    lm_intermediate: int = 192
    context_dim: int = 8


FULL_SIZE = ModelSize()
TINY_SIZE = ModelSize(layers=1, heads=1, head_dim=8, lm_intermediate=16, context_dim=4)


@dataclass(frozen=True, kw_only=True)
class TrainConfig(training.TrainConfig):
    """Optimisation settings; the defaults are the ones used for the shipped model."""

    minutes: float = 60.0
    batch_size: int = 128
    vae_batch_size: int = 128
    lm_steps: int = 600
    lm_lr: float = 3e-3
    lm_warmup_steps: int = 50


def build_language_model(tokenizer, size: ModelSize) -> Qwen2ForCausalLM:
    """An untrained tiny Qwen2 causal LM for `tokenizer` (global torch RNG)."""
    hidden = size.heads * size.head_dim
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=size.lm_intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
        head_dim=size.head_dim, max_position_embeddings=32, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS, do_sample=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return model


def build_transformer(size: ModelSize) -> SD3Transformer2DModel:
    """An untrained DiT in the digits architecture (global torch RNG): 8x8x1 latents as 16
    patches, ``size.layers`` blocks of ``size.heads`` heads x ``size.head_dim``."""
    return SD3Transformer2DModel(
        sample_size=digits_data.IMAGE_SIZE, patch_size=2, in_channels=1, out_channels=1, num_layers=size.layers,
        attention_head_dim=size.head_dim, num_attention_heads=size.heads, joint_attention_dim=size.context_dim,
        caption_projection_dim=size.heads * size.head_dim, pooled_projection_dim=size.context_dim,
        pos_embed_max_size=digits_data.IMAGE_SIZE // 2,
    )


def lm_batch(tokenizer, problems) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels) of ``<bos> prompt = answer <eos>``;
    labels are -100 except on the answer and EOS tokens."""
    rows = []
    for p in problems:
        prompt = prompt_input_ids(tokenizer, p.prompt)
        answer = tokenizer.convert_tokens_to_ids(p.answer_text)
        rows.append((prompt + [answer, tokenizer.eos_token_id], len(prompt)))
    longest = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), longest), tokenizer.pad_token_id)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    for i, (r, n_prompt) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        labels[i, n_prompt:len(r)] = torch.tensor(r[n_prompt:])
    return ids, mask, labels


def train_language_model(model, tokenizer, config: TrainConfig, deadline: float) -> training.Curve:
    """Supervised fine-tuning of `model` on the training prompts (see the module docstring)."""
    ids, mask, labels = lm_batch(tokenizer, grammar.split()[0])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lm_lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: training.warmup_cosine(s, config.lm_warmup_steps, config.lm_steps))
    model.train()

    def step_fn(step: int) -> float:
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        return loss.item()

    curve, _ = training.run_steps(step_fn, config.lm_steps, config.log_every, deadline,
                                  lambda s, l: f"lm step {s:5d}  loss {l:.4f}", budget_prefix="lm: ")
    model.eval()
    return curve


def answer_accuracy(pipe: DigitsReasoningPipeline, problems) -> float:
    """Fraction of `problems` whose greedy LM answer is the right number word."""
    texts, _ = pipe.generate_answers([p.prompt for p in problems])
    return sum(t == p.answer_text for t, p in zip(texts, problems)) / len(problems)


def encode_latents(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """Scaled latents ``(mean - shift_factor) * scaling_factor`` of float32 (N, 1, 8, 8) images in [-1, 1]."""
    with torch.no_grad():
        mean = vae.encode(images).latent_dist.mean
    return (mean - vae.config.shift_factor) * vae.config.scaling_factor


def train_dit(pipe: DigitsReasoningPipeline, latents: torch.Tensor, labels: torch.Tensor, config: TrainConfig,
              deadline: float) -> tuple[training.Curve, int]:
    """Rectified-flow training of ``pipe.transformer`` on the LM's K/V (see the module docstring)."""
    tok = pipe.tokenizer
    train = grammar.split()[0]
    sequences = [prompt_input_ids(tok, p.prompt) + [tok.convert_tokens_to_ids(p.answer_text), tok.eos_token_id]
                 for p in train]
    kv = [c for start in range(0, len(sequences), 64)
          for c in export_kv(pipe.language_model, sequences[start:start + 64], tok.pad_token_id)]
    [empty] = export_kv(pipe.language_model, [pipe.negative_context_ids("")], tok.pad_token_id)
    by_answer: dict[int, list[torch.Tensor]] = {}
    for p, c in zip(train, kv):
        by_answer.setdefault(p.answer, []).append(c)
    transformer = pipe.transformer

    def batch_loss(idx: torch.Tensor, rng: random.Random, generator: torch.Generator) -> torch.Tensor:
        contexts = [empty if rng.random() < config.empty_prompt_prob else rng.choice(by_answer[int(d)])
                    for d in labels[idx].tolist()]
        ar_kv, ar_kv_mask = pad_contexts(contexts)
        x0 = latents[idx]
        t = torch.sigmoid(torch.randn(len(x0), generator=generator))
        noise = torch.randn(x0.shape, generator=generator)
        x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        pred = transformer(hidden_states=x_t, timestep=t * 1000, return_dict=False,
                           joint_attention_kwargs={"ar_kv": ar_kv, "ar_kv_mask": ar_kv_mask},
                           **pipe.constant_context(len(x0), x0.dtype))[0]
        return F.mse_loss(pred, noise - x0)

    return training.train_denoiser([transformer], len(latents), batch_loss, config, deadline)


def write_model_card(path: Path, facts: dict) -> None:
    """The model card (markdown); the judge section is filled by ``benchmarks/quality_reasoning.py
    --update-card``."""
    size: ModelSize = facts["size"]
    config: TrainConfig = facts["config"]
    train, held = grammar.split()
    card = f"""# diffserve built-in model: `digits-reasoning` (AR stage + KV-reading DiT, 8x8 digits)

A two-stage model: a tiny causal language model answers an arithmetic question in words, and a
tiny DiT draws the answer as an 8x8 handwritten digit while attending to the language model's
per-layer keys and values (BAGEL-style; Deng et al. 2025, arXiv:2505.14683). Trained from
scratch on CPU; it ships with diffserve to exercise multi-stage serving (an AR stage feeding the
DiT through a KV connector).

```python
from diffserve.pipelines.digits_reasoning.pipeline import DigitsReasoningPipeline
from diffserve.models import BUILTIN_MODELS
pipe = DigitsReasoningPipeline.from_pretrained(BUILTIN_MODELS["digits-reasoning"])
out = pipe("three plus four")          # out.ar_texts == ["seven"], out.images[0]: an 8x8 "7"
```

```bash
diffserve generate --model digits-reasoning "three plus four"
```

## Prompts

{PROMPT_TABLE}

Prompts are lower-cased and split into words; other words become `<unk>`. {len(train)} prompts are
trained, {len(held)} held out (`training/digits_reasoning/grammar.py`: each held-out prompt asks a
trained problem in an unseen wording, e.g. `3 plus four`).

## Architecture

| component | class | config | parameters |
|---|---|---|---:|
| language_model | `Qwen2ForCausalLM` | {size.layers} layers, hidden {size.heads * size.head_dim}, {size.heads} heads x {size.head_dim} (KV heads {size.heads}), MLP {size.lm_intermediate}, tied embeddings | {facts["params"]["language_model"]:,} |
| tokenizer | `PreTrainedTokenizerFast` | word level, {facts["vocab_size"]} tokens, chat template `<bos> {{prompt}} =` | - |
| transformer | `SD3Transformer2DModel` | {size.layers} layers, {size.heads} heads x {size.head_dim}, patch 2, block i reads LM layer i's K/V | {facts["params"]["transformer"]:,} |
| vae | `AutoencoderKL` | the built-in `digits` model's VAE (frozen) | {facts["params"]["vae"]:,} |
| scheduler | `FlowMatchEulerDiscreteScheduler` | shift 1.0 | - |

The language model answers greedily with at most {MAX_NEW_TOKENS} new tokens (its
`generation_config.json`). The DiT's joint attention runs over 16 image tokens, 1 constant context
token and the LM's K/V of `<bos> prompt = answer <eos>` (5 to 8 tokens); with classifier-free
guidance the negative branch reads the K/V of `<bos> {{negative_prompt}} =` (default `""`).
The attention processor is installed by `DigitsReasoningPipeline` (and diffserve's adapter); the
saved transformer is a plain `SD3Transformer2DModel`.

## Training

Command (wall time {facts["wall_s"] / 60:.1f} min on {config.threads} CPU thread(s), torch {torch.__version__}, seed {config.seed}):

```
{facts["command"]}
```

- Language model: {facts["lm_steps"]} full-batch AdamW steps (lr {config.lm_lr}, {config.lm_warmup_steps} warm-up
  steps then cosine), cross-entropy on the answer and EOS; final loss {facts["lm_curve"][-1][1]:.4f}.
  Greedy answer accuracy: training prompts {facts["lm_train_accuracy"]:.1%}, held-out prompts {facts["lm_heldout_accuracy"]:.1%}.
- DiT: rectified flow on the {facts["num_images"]} training images of the `digits` split, {facts["steps"]} AdamW steps
  (lr {config.lr}, batch {config.batch_size}, {config.warmup_steps} warm-up then cosine), EMA {config.ema_decay};
  each image conditioned on the K/V of a random training prompt with its digit as answer, or (probability
  {config.empty_prompt_prob}) on the empty negative prompt's; final loss {facts["curve"][-1][1]:.4f}.

### Loss curve (DiT)

{training.loss_table(facts["curve"])}

## Quality (judge)

{training.QUALITY_BEGIN}
Not measured yet for these weights. Run `python benchmarks/quality_reasoning.py --update-card`.
{training.QUALITY_END}

## Limitations

- Knows only its grammar: other prompts give an arbitrary digit.
- 8x8 grayscale only.
- The LM writes one word; it is a stand-in for a reasoning LLM, small enough to ship and train in minutes.
"""
    path.write_text(card)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    training.add_run_arguments(parser, TrainConfig)
    parser.add_argument("--max-steps", type=int, default=None, help="DiT steps (default %(default)s)")
    parser.add_argument("--lm-steps", type=int, default=None, help=f"LM steps (default {TrainConfig.lm_steps})")
    parser.add_argument("--threads", type=int, default=TrainConfig.threads, help="torch.set_num_threads")
    parser.add_argument("--tiny", action="store_true", help="tiny architecture and few steps, for smoke tests")
    training.add_card_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    """Train and save the pipeline; returns the output folder."""
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    size = TINY_SIZE if args.tiny else FULL_SIZE
    tiny = {"batch_size": 16, "log_every": 1, "lm_steps": 3, "max_steps": 3, "warmup_steps": 1}
    config = training.build_config(TrainConfig, args, tiny, lm_steps=args.lm_steps)
    training.seed_everything(config)

    tokenizer = build_tokenizer()
    language_model = build_language_model(tokenizer, size)
    lm_curve = train_language_model(language_model, tokenizer, config, deadline)
    vae = AutoencoderKL.from_pretrained(DIGITS_MODEL_PATH, subfolder="vae").eval()
    pipe = DigitsReasoningPipeline(language_model=language_model, tokenizer=tokenizer,
                                   transformer=build_transformer(size), vae=vae,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0))
    pipe.set_progress_bar_config(disable=True)
    train, held = grammar.split()
    lm_train_accuracy, lm_heldout_accuracy = answer_accuracy(pipe, train), answer_accuracy(pipe, held)
    print(f"LM greedy accuracy: train {lm_train_accuracy:.1%}, held-out {lm_heldout_accuracy:.1%}", flush=True)

    images, labels = digits_data.train_tensors()
    latents = encode_latents(vae, images)
    curve, steps = train_dit(pipe, latents, labels, config, deadline)

    out = training.save_pipeline(pipe, args.out, GENERATION_DEFAULTS)
    wall_s = time.monotonic() - start
    card_path = training.model_card_path(args.card, out, DEFAULT_WEIGHTS_DIR, PACKAGE_MODEL_CARD)
    facts = {
        "size": size, "config": config, "wall_s": wall_s, "steps": steps, "curve": curve, "lm_curve": lm_curve,
        "lm_steps": lm_curve[-1][0] if lm_curve else 0, "lm_train_accuracy": lm_train_accuracy,
        "lm_heldout_accuracy": lm_heldout_accuracy, "num_images": len(images), "vocab_size": len(tokenizer),
        "params": training.component_parameters(pipe, ("language_model", "transformer", "vae")),
        "command": training.command_line("training.digits_reasoning.train", argv),
    }
    write_model_card(card_path, facts)
    (out / "training_facts.json").unlink(missing_ok=True)
    print(f"saved {out} in {wall_s:.0f} s; DiT final loss {curve[-1][1]:.4f}; card {card_path}")
    print("config:", json.dumps(asdict(config)))
    return out


if __name__ == "__main__":
    main()
