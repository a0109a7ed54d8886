"""The export for a trained drafter's method (``train.method``): EAGLE-3's layout (``export.py``) or DFlash's
(``dflash_export.py``). A module of its own, because the DFlash export builds on the EAGLE-3 one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from modeling.dflash import DFlashDrafter
from modeling.dflash_export import export_dflash
from modeling.export import TORCH_DTYPE_NAMES, export_drafter
from modeling.eagle3 import TargetTied
from modeling.target_head import read_target_config, text_config

EXPORT_DTYPES = {name: dtype for dtype, name in TORCH_DTYPE_NAMES.items()}  # the dtypes an export is written in


def export_trained(drafter: TargetTied, out_dir: Path, **kwargs: Any) -> Path:
    """Write ``drafter``'s export to ``out_dir``; ``kwargs`` as ``export.export_drafter`` takes them."""
    return (export_dflash if isinstance(drafter, DFlashDrafter) else export_drafter)(drafter, out_dir, **kwargs)


def export_dtype(model_dir: Path) -> torch.dtype:
    """The target's own dtype (``torch_dtype``, or ``dtype`` in transformers 5 configs); bf16 otherwise. Every
    export of a run's drafter is written in it, so two drafters of one target differ only in how they trained."""
    config = text_config(read_target_config(model_dir))
    return EXPORT_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")), torch.bfloat16)
