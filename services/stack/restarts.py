"""When `kvrelay up` restarts a crashed child: exponential backoff, and a limit on crash loops.

As a process manager does (systemd's Restart=on-failure, Kubernetes' CrashLoopBackOff): the
first restart waits `base_delay_s`, each further one twice as long up to `max_delay_s`; a child
that has served for `stable_after_s` since its last start has its count reset; one that crashes
`max_restarts` times in a row without that gives up, and the stack stops (a child that cannot
start, say a bad model path, must not loop forever).
"""
from __future__ import annotations

from dataclasses import dataclass


DEFAULT_MAX_RESTARTS = 5


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    max_restarts: int = DEFAULT_MAX_RESTARTS  # consecutive crashes restarted; 0: no restarts
    base_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0


@dataclass(slots=True)
class RestartState:
    """One child's crash history. `restart_at` is set while a restart is pending."""
    policy: RestartPolicy
    consecutive_crashes: int = 0
    total_restarts: int = 0
    restart_at: float | None = None
    serving_since: float | None = None

    def crashed(self, now: float) -> float | None:
        """Record a crash at `now`; returns the delay before the restart, or None to give up."""
        if self.serving_since is not None and now - self.serving_since >= self.policy.stable_after_s:
            self.consecutive_crashes = 0  # it had served a good while: a fresh crash, not a loop
        self.serving_since = None
        self.consecutive_crashes += 1
        if self.consecutive_crashes > self.policy.max_restarts:
            self.restart_at = None
            return None
        delay = min(self.policy.max_delay_s,
                    self.policy.base_delay_s * 2 ** (self.consecutive_crashes - 1))
        self.restart_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        return self.restart_at is not None and now >= self.restart_at

    def restarted(self) -> None:
        self.restart_at = None
        self.total_restarts += 1

    def serving(self, now: float) -> None:
        self.serving_since = now
