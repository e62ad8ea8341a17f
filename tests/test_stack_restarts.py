"""`kvrelay up`'s restart policy: backoff, crash-loop limit, and the supervisor restarting a real
crashed child process (a stand-in command; the whole stack's case is tests/chaos/test_worker_death.py)."""
from __future__ import annotations

import sys
import time

from kvrelay.stack.plan import ServiceSpec
from kvrelay.stack.restarts import RestartPolicy, RestartState
from kvrelay.stack.supervisor import Supervisor


def test_backoff_doubles_up_to_its_cap_then_gives_up():
    state = RestartState(RestartPolicy(max_restarts=6, base_delay_s=1.0, max_delay_s=10.0))
    delays = [state.crashed(now=float(i)) for i in range(7)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, None]
    assert state.restart_at is None  # given up: nothing pending


def test_a_child_that_served_long_enough_starts_counting_again():
    state = RestartState(RestartPolicy(max_restarts=2, stable_after_s=60.0))
    assert state.crashed(now=0.0) == 1.0
    state.restarted()
    state.serving(now=5.0)
    assert state.crashed(now=10.0) == 2.0  # served 5 s: still the same crash loop
    state.restarted()
    state.serving(now=20.0)
    assert state.crashed(now=100.0) == 1.0  # served 80 s: a fresh crash
    assert state.total_restarts == 2


def test_restarts_off_means_the_first_crash_gives_up():
    assert RestartState(RestartPolicy(max_restarts=0)).crashed(now=0.0) is None


class _Command(ServiceSpec):
    """A spec whose process is a short Python snippet instead of a kvrelay service."""
    __slots__ = ("code",)

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.code]


def _supervisor(tmp_path, code: str, policy: RestartPolicy) -> Supervisor:
    spec = _Command("scheduler", "scheduler", [], "127.0.0.1:1", "")
    spec.code = code
    gateway = ServiceSpec("gateway", "gateway", [], "127.0.0.1:2", "", rest_url="http://x")
    # the gateway is never started: the state file only needs one to name the stack's URLs
    return Supervisor([spec, gateway], "pd", tmp_path, tmp_path / "stack.json", 10.0, 5.0, {},
                      policy)


def _wait_exit(child, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while child.exit_code() is None:
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.02)
    return child.exit_code()


def test_the_supervisor_restarts_a_crashed_child_after_its_backoff(tmp_path, capsys):
    supervisor = _supervisor(tmp_path, "import sys; sys.exit(3)",
                             RestartPolicy(max_restarts=2, base_delay_s=0.2))
    child = supervisor.children[0]
    child.start({})
    supervisor.ready.add(child.name)
    first_pid = child.pid
    assert _wait_exit(child) == 3
    now = time.monotonic()
    assert supervisor._check_child(child, now, set())  # noted: a restart is pending
    assert child.name not in supervisor.ready
    assert supervisor.restarts[child.name].restart_at == now + 0.2
    assert supervisor._check_child(child, now + 0.1, set()) and child.pid == first_pid  # waits
    assert supervisor._check_child(child, now + 0.2, set())  # due: started again
    assert child.pid != first_pid and supervisor.restarts[child.name].total_restarts == 1
    said = capsys.readouterr().out
    assert "scheduler exited with code 3 while serving; restarting it in 0s" in said
    assert "scheduler  restarted (pid" in said
    state = (tmp_path / "stack.json").read_text()
    assert '"status": "degraded"' in state and '"restarts": 1' in state
    _wait_exit(child)
    later = time.monotonic()
    assert supervisor._check_child(child, later, set())
    assert supervisor._check_child(child, later + 0.4, set())  # the second restart, 0.4 s later
    _wait_exit(child)
    assert not supervisor._check_child(child, time.monotonic(), set())  # the third: give up


def test_a_worker_that_exits_cleanly_is_retired_not_restarted(tmp_path):
    supervisor = _supervisor(tmp_path, "pass", RestartPolicy())
    child = supervisor.children[0]
    child.spec.kind = "worker"
    child.start({})
    supervisor.ready.add(child.name)
    assert _wait_exit(child) == 0
    retired: set[str] = set()
    assert supervisor._check_child(child, time.monotonic(), retired)
    assert retired == {child.name} and supervisor.restarts[child.name].restart_at is None
