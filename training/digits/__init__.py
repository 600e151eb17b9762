"""Training data (`data`) and trainer (`train`) of the built-in ``digits`` model:
``python -m training.digits.train --help``."""
