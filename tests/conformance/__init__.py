"""The conformance suite: every step-batched family (``tiny_models.registry``) held to the same
checks: diffusers parity, batch invariance, named refusals, cache backends, abort, events."""
