"""Training of diffserve's built-in models (outside the wheel; run from the repository root):
shared loops and helpers (`common`), the text-to-image digits model (`digits`), the video model
(`digits_video`), and the TeaCache calibration tool (`teacache_calibrate`). The trained weights
ship in the package (``diffserve/models/``)."""
