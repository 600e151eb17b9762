"""Training clips (`data`) and trainer (`train`) of the built-in ``digits-video`` model:
``python -m training.digits_video.train --help``."""
