"""Typed dependencies the routes declare (full-stack-fastapi-template style)."""

from __future__ import annotations

from typing import Annotated

import redis
from fastapi import Depends, Request

from services.control.manager import JobManager
from services.control.plane import ControlPlane
from services.control.settings import ControlSettings


def get_settings(request: Request) -> ControlSettings:
    settings: ControlSettings = request.app.state.settings
    return settings


def get_plane(request: Request) -> ControlPlane:
    plane: ControlPlane = request.app.state.plane
    return plane


def get_manager(request: Request) -> JobManager:
    return get_plane(request).manager


def get_redis(request: Request) -> redis.Redis:
    return get_plane(request).redis


SettingsDep = Annotated[ControlSettings, Depends(get_settings)]
PlaneDep = Annotated[ControlPlane, Depends(get_plane)]
ManagerDep = Annotated[JobManager, Depends(get_manager)]
RedisDep = Annotated[redis.Redis, Depends(get_redis)]
