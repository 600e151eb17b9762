"""The conformance suite: every step-batched family of ``tiny_models.registry`` held to the same
checks (diffusers parity, batch invariance, named refusals of unused fields, cache backends run or
refused by name, abort, events, output types, generation-config defaults, truncation, streams).

A test id reads ``test_<check>[<registry model id>(-<case>)]``; a failure message starts with the
model id and the check and gives the largest difference seen (also in uint8 levels), e.g.
``FluxPipeline-dev: diffusers parity (guided): max |difference| 0.0052 (1.33 uint8 levels) >
1e-05``. ``DIFFSERVE_CONFORMANCE_REPORT=/path/file.jsonl`` makes every comparison append its
measured difference and tolerance to that file (the margins, for a before/after report).
Run it alone: ``python -m pytest tests/conformance`` (one model: ``-k FluxPipeline-dev``).
"""
