"""Dependencies the routes share: the settings and the Redis connection the app was built with."""

from __future__ import annotations

from typing import Annotated

import redis
from fastapi import Depends, Request

from shared.settings import ControllerSettings


def get_settings(request: Request) -> ControllerSettings:
    return request.app.state.settings


def get_conn(request: Request) -> redis.Redis:
    return request.app.state.conn


SettingsDep = Annotated[ControllerSettings, Depends(get_settings)]
ConnDep = Annotated[redis.Redis, Depends(get_conn)]
