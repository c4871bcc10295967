"""Leader election between control replicas on the shared Redis: a lease and a fencing term.

The leader holds ``sf:control:leader`` (set only where absent, with a TTL, naming a random token) and
renews it every ``leader_retry_ms``; each election INCRs ``sf:control:term``, the fencing token every
write of the job store compares (store.py), so a deposed leader's writes are refused. A leader acts
only until ``leader_renew_deadline_ms`` after its last successful renewal began, which is shorter than
the lease's TTL: paused or cut off, it stops before a standby can take the lease (as client-go's
leaderelection does). Only the leader sweeps, sends commands and serves the Registry.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis

from services.control.errors import NotLeader
from shared import constants

log = logging.getLogger(__name__)

# KEYS: lease, term. ARGV: token, TTL (ms), holder (JSON). Taking the lease and counting the term are
# one step: a replica that died between the two would leave a lease without its term.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local term = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], term .. ' ' .. ARGV[1] .. ' ' .. ARGV[3], 'PX', ARGV[2])
return term
"""
# KEYS: lease. ARGV: the value this replica wrote, TTL (ms). Only the holder renews or releases.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class Replica:
    """A control replica as services and clients reach it."""

    replica_id: str
    api_url: str = ""
    grpc_target: str = ""


@dataclass(frozen=True)
class Leader:
    term: int
    replica: Replica


def parse_lease(raw: bytes | str | None) -> Leader | None:
    """The lease's holder and term ("<term> <token> <holder JSON>"), None when nobody holds it."""
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    term, _token, holder = text.split(" ", 2)
    return Leader(int(term), Replica(**json.loads(holder)))


class LeaderElection:
    """Campaigns for the lease on a thread of its own; ``check()`` says whether this replica may act.

    ``on_change(term)`` listeners hear each change of role: the new term on taking the lead, 0 on
    stepping down. Without ``start()`` (unit tests) the replica never leads.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        ttl_ms: int,
        renew_deadline_ms: int,
        retry_ms: int,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_ms < renew_deadline_ms < ttl_ms:
            raise ValueError(
                f"leader election needs retry ({retry_ms} ms) < renew deadline ({renew_deadline_ms} ms) "
                f"< lease TTL ({ttl_ms} ms): a leader must stop acting before its lease can expire"
            )
        self.client = client
        self.ttl_ms = ttl_ms
        self.renew_deadline_s = renew_deadline_ms / 1000
        self.retry_s = retry_ms / 1000
        self.monotonic = monotonic
        self.me = Replica("")
        self._acquire = client.register_script(_ACQUIRE)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._token = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._term = 0  # while leading
        self._value = ""  # the lease's value while leading
        self._valid_until = 0.0  # monotonic: this replica acts until then unless a renewal extends it
        self._listeners: list[Callable[[int], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_change(self, listener: Callable[[int], None]) -> None:
        self._listeners.append(listener)

    # --- the campaign ------------------------------------------------------------------------------
    def start(self, me: Replica) -> None:
        """Campaign once now (a lone control leads before it serves), then every retry period."""
        self.me = me
        self._stop.clear()
        try:
            self.campaign()
        except redis.RedisError as e:
            log.warning("leader election: Redis is unavailable (%s); retrying", e)
        self._thread = threading.Thread(target=self._run, name="control-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop campaigning and release the lease, so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            value = self._value
        self._step_down("shutting down", logging.INFO)
        if value:
            try:
                self._release(keys=[constants.REDIS_CONTROL_LEADER], args=[value])
            except redis.RedisError as e:
                log.warning("could not release the leader lease (it expires by itself): %s", e)

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.retry_s):
            try:
                self.campaign()
                failing = False
            except redis.RedisError as e:
                log.log(logging.DEBUG if failing else logging.WARNING, "leader election: %s (retrying)", e)
                failing = True
                with self._lock:
                    expired = self._term > 0 and self.monotonic() >= self._valid_until
                if expired:
                    self._step_down("no renewal reached Redis before the renew deadline")
            except Exception:  # the campaign must outlive any one bad round
                log.exception("leader election round failed")

    def campaign(self) -> bool:
        """Renew the lease if this replica holds it, else try to take it; True while leading."""
        began = self.monotonic()
        with self._lock:
            term, value, valid_until = self._term, self._value, self._valid_until
        if term and began >= valid_until:
            # It acted on this lease for the last time at its deadline: let a standby have it now.
            self._step_down("no renewal reached Redis before the renew deadline")
            self._release(keys=[constants.REDIS_CONTROL_LEADER], args=[value])
            term = 0
        if term:
            if self._renew(keys=[constants.REDIS_CONTROL_LEADER], args=[value, self.ttl_ms]):
                with self._lock:
                    if self._term == term:
                        self._valid_until = began + self.renew_deadline_s
                return True
            self._step_down("the lease is no longer this replica's")
        holder = json.dumps(asdict(self.me), separators=(",", ":"))
        won = int(
            self._acquire(
                keys=[constants.REDIS_CONTROL_LEADER, constants.REDIS_CONTROL_TERM],
                args=[self._token, self.ttl_ms, holder],
            )
        )
        if not won:
            return False
        with self._lock:
            self._term = won
            self._value = f"{won} {self._token} {holder}"
            self._valid_until = began + self.renew_deadline_s
        log.info("leading control as %s (term %d)", self.me.replica_id, won)
        self._tell(won)
        return True

    def _step_down(self, why: str, level: int = logging.WARNING) -> None:
        with self._lock:
            term, self._term, self._value, self._valid_until = self._term, 0, "", 0.0
        if term:
            log.log(level, "stepping down as control's leader (term %d): %s", term, why)
            self._tell(0)

    def _tell(self, term: int) -> None:
        for listener in self._listeners:
            try:
                listener(term)
            except Exception:
                log.exception("leader listener failed")

    # --- what the rest of control asks --------------------------------------------------------------
    def is_leader(self) -> bool:
        with self._lock:
            return self._term > 0 and self.monotonic() < self._valid_until

    def check(self) -> int:
        """The term this replica leads in; NotLeader (naming the leader) when it may not act."""
        with self._lock:
            if self._term > 0 and self.monotonic() < self._valid_until:
                return self._term
        raise self.refusal()

    def deposed(self, term: int) -> NotLeader:
        """The store found a newer term than ``term``: step down (if still on it); the error to raise."""
        with self._lock:
            current = self._term
        if current == term:
            self._step_down(f"the job store's term has moved past {term}")
        return self.refusal()

    def current(self) -> Leader | None:
        """Who holds the lease now, read from Redis."""
        return parse_lease(self.client.get(constants.REDIS_CONTROL_LEADER))

    def refusal(self) -> NotLeader:
        """What a standby answers a change with: where the leader is, or that there is none now."""
        try:
            leader = self.current()
        except redis.RedisError:
            leader = None
        me = self.me.replica_id or "this replica"
        if leader is None or leader.replica.replica_id == self.me.replica_id:
            return NotLeader(f"control {me} is not the leader and no replica leads right now; retry shortly")
        where = leader.replica.api_url or leader.replica.grpc_target
        return NotLeader(
            f"control {me} is a standby: the leader is {leader.replica.replica_id} at {where} (term "
            f"{leader.term}); send changes there",
            leader.replica.api_url,
            leader.replica.grpc_target,
        )
