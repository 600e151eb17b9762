"""The arithmetic grammar of the built-in ``digits-reasoning`` model, and its fixed train /
held-out split.

Prompts (``X``, ``Y``: number words ``zero`` .. ``nine`` or digits ``0`` .. ``9``; every answer
is a single digit 0..9):

=========================  =======================  =========
prompt                     condition                answer
=========================  =======================  =========
``X plus Y``               X + Y <= 9               X + Y
``X minus Y``              X >= Y                   X - Y
``the number after X``     X <= 8                   X + 1
``the number before X``    X >= 1                   X - 1
``half of X``              X even                   X / 2
``twice X``                X <= 4                   2 X
=========================  =======================  =========

Each problem (operation and operands) has several surface forms (each operand written as a
word or as a digit): 496 prompts for 190 problems. The held-out split keeps 20 % of the
prompts out of training, chosen with a fixed seed so that every problem keeps at least one
training form: a held-out prompt asks a known problem in an unseen wording (``3 plus four``
when ``three plus four``, ``three plus 4`` and ``3 plus 4`` were trained), which the language
model must answer from what it learnt about number words and digits.

The language model answers with the number word (``seven``); the image model draws that digit.
Pure Python, no torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

DIGIT_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
)
#: Fraction of the prompts held out of training, and the seed that picks them.
HELDOUT_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass(frozen=True)
class Problem:
    """One prompt of the grammar.

    Attributes:
        prompt: the text, e.g. ``"three plus 4"``.
        answer: the digit it evaluates to (0..9).
        key: the problem it writes (operation and operand values, e.g. ``("plus", 3, 4)``);
            prompts with equal keys differ only in wording.
    """

    prompt: str
    answer: int
    key: tuple

    @property
    def answer_text(self) -> str:
        """The language model's answer: the number word (``"seven"``)."""
        return DIGIT_WORDS[self.answer]


def _forms(value: int) -> tuple[str, str]:
    return DIGIT_WORDS[value], str(value)


def all_problems() -> list[Problem]:
    """Every prompt of the grammar (496), in a fixed order."""
    problems: list[Problem] = []
    for x in range(10):
        for y in range(10):
            for op, ok, answer in (("plus", x + y <= 9, x + y), ("minus", x >= y, x - y)):
                if ok:
                    problems += [Problem(f"{a} {op} {b}", answer, (op, x, y))
                                 for a in _forms(x) for b in _forms(y)]
    for x in range(10):
        unary = (("the number after {}", x <= 8, x + 1, "after"), ("the number before {}", x >= 1, x - 1, "before"),
                 ("half of {}", x % 2 == 0, x // 2, "half"), ("twice {}", x <= 4, 2 * x, "twice"))
        for template, ok, answer, op in unary:
            if ok:
                problems += [Problem(template.format(a), answer, (op, x)) for a in _forms(x)]
    return problems


@lru_cache(maxsize=1)
def split() -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    """The fixed (train, held-out) split of :func:`all_problems` (see the module docstring).

    Returns:
        ``(train, heldout)``: disjoint tuples, together every prompt, each in the order of
        :func:`all_problems`; every problem key has at least one training prompt.
    """
    problems = all_problems()
    order = list(range(len(problems)))
    random.Random(SPLIT_SEED).shuffle(order)
    target = round(HELDOUT_FRACTION * len(problems))
    remaining: dict[tuple, int] = {}
    for p in problems:
        remaining[p.key] = remaining.get(p.key, 0) + 1
    heldout: set[int] = set()
    for i in order:
        if len(heldout) == target:
            break
        if remaining[problems[i].key] > 1:
            heldout.add(i)
            remaining[problems[i].key] -= 1
    train = tuple(p for i, p in enumerate(problems) if i not in heldout)
    held = tuple(p for i, p in enumerate(problems) if i in heldout)
    return train, held


def vocabulary() -> tuple[str, ...]:
    """The words of the grammar (the language model's word-level vocabulary, besides its
    special tokens and ``=``), in a fixed order."""
    words = list(DIGIT_WORDS) + [str(d) for d in range(10)]
    for w in ("plus", "minus", "the", "number", "after", "before", "half", "of", "twice"):
        words.append(w)
    return tuple(words)
