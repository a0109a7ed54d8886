"""``/status``: the self-refreshing status page (see ``services.controller.api.page``)."""

from __future__ import annotations

from functools import lru_cache

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from services.controller.api.page import render_page
from services.controller.api.routes.deps import ConnDep, SettingsDep
from services.controller.runs.status import list_status
from runtime.gpu import GpuReader

router = APIRouter(tags=["page"])


@lru_cache(maxsize=1)
def gpu_reader() -> GpuReader:
    return GpuReader()  # NVML initialises once per process


@router.get("/status", response_class=HTMLResponse)
def status_page(settings: SettingsDep, conn: ConnDep) -> str:
    return render_page(list_status(settings.data, conn), gpu_reader().read())
