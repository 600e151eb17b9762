"""The ``digits-reasoning`` family: a causal LM (AR stage) whose per-layer K/V an
SD3-architecture DiT reads (`ar_context_attention`); `pipeline.DigitsReasoningPipeline` is the
diffusers-style reference."""
