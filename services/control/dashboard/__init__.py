"""The live dashboard: ``app.include_router(dashboard.router)`` serves /dashboard and /dashboard/data."""

from services.control.dashboard.data import DashboardSources
from services.control.dashboard.routes import router

__all__ = ["DashboardSources", "router"]
