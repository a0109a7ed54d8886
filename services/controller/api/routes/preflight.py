"""``GET /preflight``: every check a run needs, without a run (see ``services.controller.runs.preflight``)."""

from __future__ import annotations

from fastapi import APIRouter

from services.controller.runs.preflight import run_preflight
from services.controller.api.routes.deps import SettingsDep

router = APIRouter(tags=["preflight"])


@router.get("/preflight")
def preflight(settings: SettingsDep) -> dict:
    """The report as JSON; always 200 (``ok`` says whether a run may start without force)."""
    return run_preflight(settings).to_dict()
