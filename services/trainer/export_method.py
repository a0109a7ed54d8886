"""The export for a trained drafter's method (``train.method``): EAGLE-3's layout (``export.py``) or DFlash's
(``dflash_export.py``). A module of its own, because the DFlash export builds on the EAGLE-3 one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.trainer.dflash import DFlashDrafter
from services.trainer.dflash_export import export_dflash
from services.trainer.export import export_drafter
from services.trainer.model import TargetTied


def export_trained(drafter: TargetTied, out_dir: Path, **kwargs: Any) -> Path:
    """Write ``drafter``'s export to ``out_dir``; ``kwargs`` as ``export.export_drafter`` takes them."""
    return (export_dflash if isinstance(drafter, DFlashDrafter) else export_drafter)(drafter, out_dir, **kwargs)
