"""The offline word-level tokenizer of ``digits-reasoning``'s language model.

One token per word of the grammar (`grammar.vocabulary`), plus ``=`` (the answer prompt) and
the special tokens ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3). Text is
lower-cased and split on whitespace and punctuation; any other word becomes ``<unk>``.

Prompts are formatted with the tokenizer's chat template (what the AR stage uses for any
causal LM that has one): ``<bos> {prompt} =`` with the generation prompt, after which the model
writes its answer word and ``<eos>``. Built in memory with the ``tokenizers`` library; nothing
is downloaded.
"""

from __future__ import annotations

from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from training.digits_reasoning.grammar import vocabulary

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
ANSWER_PROMPT = "="
#: Jinja chat template: the user's text after BOS, then `` =`` as the generation prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %} {{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %} =" "{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer (vocabulary: special tokens, then ``=``, then the grammar's words)."""
    tokens = list(SPECIAL_TOKENS) + [ANSWER_PROMPT] + list(vocabulary())
    backend = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        model_max_length=32, padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
