"""Training code of the built-in ``digits-reasoning`` model (not part of the wheel): the
grammar and its split (`grammar`), the language model's offline tokenizer (`tokenizer`), and
the trainer (`train`)."""
