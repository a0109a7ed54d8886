"""Liveness: the process answers; whether Redis does is reported, not required."""

from __future__ import annotations

import redis
from fastapi import APIRouter

from services.controller.api.routes.deps import ConnDep

router = APIRouter(tags=["health"])


@router.get("/health")
def health(conn: ConnDep) -> dict:
    try:
        redis_ok = bool(conn.ping())
    except redis.RedisError:
        redis_ok = False
    return {"status": "ok", "redis": redis_ok}
