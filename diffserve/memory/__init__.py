"""Memory of the device a worker uses: accounting (`accounting`: the process peak, bytes of
weights, measurement windows), the activation profile measured for admission (`profile`),
offload (`offload`: model CPU offload, layerwise offload) and sleep mode's weights side
(`sleep`). The engine's admission arithmetic over the profile is the request scheduler's
(`diffserve.engine.memory_budget`); a runner's composition of these pieces for its model is
`diffserve.runner.model_memory`.
"""
