"""The drafter methods the trainer builds from one store of hidden states, and how a saved config names its
method: EAGLE-3 (``model.py``, the default, configs without a ``method`` key) and DFlash (``dflash.py``)."""

from __future__ import annotations

from typing import Any

from modeling.dflash import METHOD as DFLASH, DFlashConfig, DFlashDrafter
from modeling.eagle3 import DrafterConfig, Eagle3Drafter, TargetTied

EAGLE3 = "eagle3"
METHODS = (EAGLE3, DFLASH)

AnyConfig = DrafterConfig | DFlashConfig


def config_from_dict(data: dict[str, Any]) -> AnyConfig:
    """A checkpoint's saved config; ValueError or TypeError for a method or field this trainer does not know."""
    method = data.get("method", EAGLE3)
    if method == DFLASH:
        return DFlashConfig.from_dict(data)
    if method != EAGLE3:
        raise ValueError(f"drafter method {method!r} is not one of {list(METHODS)}")
    return DrafterConfig(**{k: v for k, v in data.items() if k != "method"})


def method_of(config: AnyConfig) -> str:
    return DFLASH if isinstance(config, DFlashConfig) else EAGLE3


def new_drafter(config: AnyConfig) -> TargetTied:
    return DFlashDrafter(config) if isinstance(config, DFlashConfig) else Eagle3Drafter(config)
