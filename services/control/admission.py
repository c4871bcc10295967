"""Each API token's share: how many active jobs it may have and how many submissions it may make a
minute (``SF_CONTROL_MAX_JOBS_PER_TOKEN``, ``SF_CONTROL_SUBMISSIONS_PER_MINUTE``).

A token is known by a digest (``api.auth.token_owner``), stored on its jobs; the submissions of the
last minute are counted in the leader's memory, so a new leader starts counting afresh.
"""

from __future__ import annotations

import math
import threading
from collections import deque

from services.control.errors import Overloaded
from services.control.settings import ControlSettings
from services.control.store import JobRecord
from shared.clock import Clock
from shared.jobstate import ACTIVE_STATES

MINUTE_MS = 60_000
# A token at its job limit gets its answer again once a job may have ended; cancelling one is faster.
JOBS_RETRY_AFTER_S = 60


def _who(owner: str) -> str:
    return f"token {owner}" if owner else "the API (no token)"


class Admission:
    def __init__(self, settings: ControlSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self._recent: dict[str, deque[int]] = {}
        self._lock = threading.Lock()

    def count_submission(self, owner: str) -> None:
        """Count a submission of ``owner``'s; Overloaded (with when to retry) past its rate."""
        limit = self.settings.submissions_per_minute
        if not limit:
            return
        now = self.clock()
        with self._lock:
            recent = self._recent.setdefault(owner, deque())
            while recent and recent[0] <= now - MINUTE_MS:
                recent.popleft()
            if len(recent) >= limit:
                retry_s = max(1, math.ceil((recent[0] + MINUTE_MS - now) / 1000))
                raise Overloaded(
                    f"{_who(owner)} made {limit} job submissions in the last minute, its most "
                    f"(SF_CONTROL_SUBMISSIONS_PER_MINUTE); try again in {retry_s} s",
                    retry_after_s=retry_s,
                )
            recent.append(now)

    def check_jobs(self, owner: str, jobs: list[JobRecord]) -> None:
        """Overloaded when ``owner`` already has its most active jobs."""
        limit = self.settings.max_jobs_per_token
        if not limit:
            return
        active = sum(1 for j in jobs if j.owner == owner and j.state in ACTIVE_STATES)
        if active >= limit:
            raise Overloaded(
                f"{_who(owner)} has {active} active job(s), its most (SF_CONTROL_MAX_JOBS_PER_TOKEN); "
                "cancel one before submitting another",
                retry_after_s=JOBS_RETRY_AFTER_S,
            )
