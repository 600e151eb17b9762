"""The executor boundary: the engine hands plain work items (`messages`) to workers that own
the model and every request's tensors. `InProcessExecutor` runs one `ModelRunner` in this
process (encode/decode on a side thread, overlapping denoising steps)."""

from diffserve.executor.base import Executor
from diffserve.executor.inprocess import InProcessExecutor

__all__ = ["Executor", "InProcessExecutor", "build_ar_stage", "build_executor"]


def build_ar_stage(config, executor):
    """A multi-stage model's AR stage client (`diffserve.executor.ar_stage.build_ar_stage`)."""
    from diffserve.executor.ar_stage import build_ar_stage as build

    return build(config, executor)


def build_executor(config) -> Executor:
    """The executor `config` asks for: in-process for one rank (unless ``executor=
    "multiprocess"``), else one worker process per rank (`multiproc.MultiprocExecutor`)."""
    if config.executor == "multiprocess" or (config.executor == "auto" and config.world_size > 1):
        from diffserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    return InProcessExecutor(config)
