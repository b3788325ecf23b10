"""One scheduler at a time: a leader lease in Redis.

Every scheduler process tries `SET lockstep:scheduler:leader <id> NX PX <ttl>`; the one that
gets it runs passes and renews the lease before each one (an atomic compare-and-extend: only
the holder extends it). The others stand by and try again every tick, so a standby takes over
at most one TTL after the leader dies. A leader that cannot renew (it was paused past the TTL,
or Redis restarted and another took the key) stops before its next pass, and says so.

The lease is checked right before each pass, not during it: a leader frozen in the middle of a
pass for longer than the TTL can still apply that one plan beside the new leader's. Correctness
does not rest on the lease: every claim is re-checked by the database (the partial unique index
on live allocations and the conditional QUEUED -> STARTING update), so such an overlap costs a
rejected gang, never a GPU given twice. The lease keeps passes, preemption decisions and wait
reasons one scheduler's view.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import uuid

import redis
from django.db import connection

from jobs.scheduling.wake import redis_client

log = logging.getLogger(__name__)

LEADER_KEY = "lockstep:scheduler:leader"

# Extend the lease only if we still hold it: GET and PEXPIRE in one step.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def lease_key(database: dict | None = None) -> str:
    """One lease per database (`database`: a DATABASES entry, the default connection's if
    None): two deployments, or a test cluster beside `make up`, that share a Redis server must
    not stand each other by."""
    where = database or connection.settings_dict
    name = f"{where.get('HOST') or ''}:{where.get('PORT') or ''}/{where['NAME']}"
    return f"{LEADER_KEY}:{hashlib.sha256(name.encode()).hexdigest()[:16]}"


class LeaderLease:
    def __init__(self, ttl_s: float, client: redis.Redis | None = None, key: str | None = None):
        self.ttl_ms = max(int(ttl_s * 1000), 1000)
        self.key = key or lease_key()
        self.client = client or redis_client()
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.held: bool | None = None  # None until the first try, so the first role is logged

    def acquire_or_renew(self) -> bool:
        """True if this process leads for the next TTL. Logs each change of role once."""
        try:
            if self.held:
                held = bool(self.client.eval(_RENEW, 1, self.key, self.identity, self.ttl_ms))
            else:
                held = bool(self.client.set(self.key, self.identity, nx=True, px=self.ttl_ms))
        except redis.RedisError as exc:
            # Without Redis nobody can prove leadership; a leader keeps going only while its
            # lease would still be valid anyway is not knowable here, so it stands by: the
            # wake channel is down too, and passes resume when Redis is back.
            log.warning("leader lease unavailable (%s); standing by", exc)
            held = False
        if held != self.held:
            if held:
                log.info("scheduler %s is the leader", self.identity)
            else:
                log.warning(
                    "scheduler %s is not the leader (held by %s); standing by",
                    self.identity,
                    self.holder(),
                )
        self.held = held
        return held

    def holder(self) -> str | None:
        try:
            value = self.client.get(self.key)
        except redis.RedisError:
            return None
        return value.decode() if isinstance(value, bytes) else value

    def release(self) -> None:
        if not self.held:
            return
        try:
            self.client.eval(_RELEASE, 1, self.key, self.identity)
        except redis.RedisError as exc:
            log.warning("could not release the leader lease (%s); it expires by itself", exc)
        self.held = False
