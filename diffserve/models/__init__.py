"""Models that ship with diffserve (see `diffserve.models.digits`, the built-in default)."""
