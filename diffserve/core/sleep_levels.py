"""Sleep levels of vLLM's sleep mode, as `DiffusionEngine.sleep` and ``POST /sleep`` take them
(what each level does to the weights: `diffserve.memory.sleep`).

- 1: the weights move off the device and are kept (waking copies them back);
- 2: the weights are discarded (waking reloads them from the model folder).
"""

from __future__ import annotations

from typing import Any

from diffserve.core.errors import InvalidRequestError

SLEEP_LEVELS = (1, 2)


def check_level(level: Any) -> int:
    """`level` as an int.

    Raises:
        InvalidRequestError: not 1 or 2.
    """
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise InvalidRequestError("level", level, "1 (weights off the device, kept) or 2 (weights discarded, "
                                  "reloaded from the model folder on wake)")
    return int(level)
