"""The executor boundary: the engine hands plain work items (`messages`) to workers that own
the model and every request's tensors. `InProcessExecutor` runs one `ModelRunner` in this
process (encode/decode on a side thread, overlapping denoising steps)."""

from diffserve.executor.base import Executor
from diffserve.executor.inprocess import InProcessExecutor

__all__ = ["Executor", "InProcessExecutor", "build_executor"]


def build_executor(config) -> Executor:
    """The executor `config` asks for (today: in-process)."""
    return InProcessExecutor(config)
