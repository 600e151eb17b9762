"""Training of diffserve's built-in models (outside the wheel; run from the repository root):
shared loops and helpers (`common`), the text-to-image digits model (`digits`) and the video model
(`digits_video`). The trained weights ship in the package (``diffserve/models/``); their
step-caching calibration is ``diffserve calibrate-cache --model NAME``."""
