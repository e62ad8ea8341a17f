"""Runs the stack: start services as their dependencies become healthy, watch them, restart the
ones that crash (restarts.py), stop them.

One thread, one polling loop; signal handlers only count signals, so every decision (start,
restart, fail, stop) happens in the loop where the state is plain. A second Ctrl-C skips the
graceful stop.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

from kvrelay.stack.child import Child
from kvrelay.stack.health import HealthProbe
from kvrelay.stack.plan import ServiceSpec
from kvrelay.stack.restarts import RestartPolicy, RestartState
from kvrelay.stack.state import stack_state, write_state

POLL_S = 0.2
RESTART_PROBE_EVERY_S = 1.0  # how often a restarted child's health is asked until it serves
PROGRESS_EVERY_S = 10.0
# Stop order: nothing new comes in, then the front services drain, then the workers go.
STOP_STAGES = (("gateway",), ("tokenizer", "scheduler"), ("worker",))


class Supervisor:
    def __init__(self, specs: list[ServiceSpec], topology: str, log_dir: Path | None,
                 state_path: Path | None, startup_timeout_s: float, stop_timeout_s: float,
                 base_env: dict[str, str], restart_policy: RestartPolicy | None = None) -> None:
        self.children = [Child(spec, log_dir) for spec in specs]
        policy = restart_policy or RestartPolicy()
        self.restarts = {child.name: RestartState(policy) for child in self.children}
        self.topology = topology
        self.state_path = state_path
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.base_env = base_env
        self.ready: set[str] = set()
        self.num_signals = 0
        self.started_at = time.monotonic()

    # ---- the whole life ------------------------------------------------------------------------
    def run(self) -> int:
        self._install_signal_handlers()
        code = 1
        try:
            if self._start_all():
                self._publish("ready")
                self._print_endpoints()
                code = self._watch()
            elif self.num_signals:
                code = 0
        finally:
            self._publish("stopping")
            self._stop_all()
            self._publish("stopped" if code == 0 else "failed")
        return code

    def _install_signal_handlers(self) -> None:
        def on_signal(signum, frame) -> None:
            self.num_signals += 1
        # SIGHUP too: a closed terminal should stop the stack gracefully, not by PDEATHSIG.
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, on_signal)

    # ---- start-up ------------------------------------------------------------------------------
    def _start_all(self) -> bool:
        """Start each child once its dependencies are SERVING; True when all are."""
        probes = {child.name: _probe(child.spec) for child in self.children}
        deadline = self.started_at + self.startup_timeout_s
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        statuses: dict[str, str] = {}
        try:
            while len(self.ready) < len(self.children):
                if self.num_signals:
                    say("interrupted during start-up")
                    return False
                self._start_runnable()
                if not self._poll_startup(probes, statuses):
                    return False
                if time.monotonic() > deadline:
                    self._report_timeout(statuses)
                    return False
                if time.monotonic() > next_progress:
                    waiting = [f"{name} ({status})" for name, status in statuses.items()
                               if name not in self.ready]
                    say(f"still waiting for {', '.join(waiting)}")
                    next_progress += PROGRESS_EVERY_S
                time.sleep(POLL_S)
            return True
        finally:
            for probe in probes.values():
                probe.close()

    def _start_runnable(self) -> None:
        for child in self.children:
            if not child.started() and all(dep in self.ready for dep in child.spec.depends_on):
                child.start(self.base_env)
                say(f"{child.name:<10} started (pid {child.pid}) on {child.spec.address}")
                self._publish("starting")

    def _poll_startup(self, probes: dict[str, HealthProbe], statuses: dict[str, str]) -> bool:
        """Check every started child once; False if one has died."""
        for child in self.children:
            if not child.started() or child.name in self.ready:
                continue
            if child.exit_code() is not None:
                self._report_death(child, "during start-up")
                return False
            statuses[child.name] = probes[child.name].status()
            if statuses[child.name] == "SERVING":
                self.ready.add(child.name)
                self.restarts[child.name].serving(time.monotonic())
                say(f"{child.name:<10} SERVING after {time.monotonic() - self.started_at:.1f}s")
                self._publish("starting")
        return True

    def _report_timeout(self, statuses: dict[str, str]) -> None:
        for child in self.children:
            if child.name not in self.ready:
                status = statuses.get(child.name, "not started")
                say(f"{child.name} is not ready after {self.startup_timeout_s:.0f}s ({status}); "
                    f"its log ends:\n{indent(child.log_tail())}")

    def _report_death(self, child: Child, when: str) -> None:
        say(f"{child.name} exited with code {child.exit_code()} {when}; "
            f"its log ends:\n{indent(child.log_tail())}")

    # ---- running -------------------------------------------------------------------------------
    def _watch(self) -> int:
        """Serve until a signal (0) or a child that crashed more often than the restart policy
        allows (1). A crashed child is restarted after its backoff while the rest serves on; a
        worker that exits cleanly was drained (SIGTERM) and left its group on purpose."""
        retired: set[str] = set()
        probes: dict[str, HealthProbe] = {}
        next_probe = 0.0
        try:
            while not self.num_signals:
                now = time.monotonic()
                for child in self.children:
                    if child.name in retired:
                        continue
                    if not self._check_child(child, now, retired):
                        return 1
                if now >= next_probe:
                    self._probe_restarted(probes, now)
                    next_probe = now + RESTART_PROBE_EVERY_S
                time.sleep(POLL_S)
        finally:
            for probe in probes.values():
                probe.close()
        say("stopping")
        return 0

    def _check_child(self, child: Child, now: float, retired: set[str]) -> bool:
        """Restart a child whose backoff is over, note a new death; False: give up."""
        state = self.restarts[child.name]
        if state.due(now):
            child.kill_group()  # whatever the dead child left behind
            child.start(self.base_env)
            state.restarted()
            say(f"{child.name:<10} restarted (pid {child.pid}, restart {state.total_restarts})")
            self._publish("degraded")
            return True
        code = child.exit_code()
        if code is None or state.restart_at is not None:
            return True
        if code == 0 and child.spec.kind == "worker":
            retired.add(child.name)
            self.ready.discard(child.name)
            say(f"{child.name} drained and left its group")
            self._publish(self._serving_status())
            return True
        self.ready.discard(child.name)
        delay = state.crashed(now)
        if delay is None:
            self._report_death(child, f"while serving, {state.consecutive_crashes} times in a "
                                      f"row; giving up and stopping the stack")
            return False
        self._report_death(child, f"while serving; restarting it in {delay:.0f}s")
        self._publish("degraded")
        return True

    def _probe_restarted(self, probes: dict[str, HealthProbe], now: float) -> None:
        """Mark restarted children SERVING again once their health says so."""
        for child in self.children:
            if child.name in self.ready or not child.alive():
                continue
            if child.name not in probes:
                probes[child.name] = _probe(child.spec)
            if probes[child.name].status() == "SERVING":
                self.ready.add(child.name)
                self.restarts[child.name].serving(now)
                say(f"{child.name:<10} SERVING again")
                self._publish(self._serving_status())

    def _serving_status(self) -> str:
        down = [c for c in self.children if c.name not in self.ready and c.exit_code() != 0]
        return "degraded" if down else "ready"

    def _print_endpoints(self) -> None:
        gateways = [child.spec for child in self.children if child.spec.kind == "gateway"]
        lines = [f"kvrelay is up ({self.topology}, {time.monotonic() - self.started_at:.1f}s)",
                 *(f"  OpenAI REST  {gateway.rest_url}/v1" for gateway in gateways),
                 *(f"  gRPC API     {gateway.address}" for gateway in gateways),
                 f"  {'service':<11}{'pid':<9}{'gRPC':<22}metrics"]
        for child in self.children:
            lines.append(f"  {child.name:<11}{child.pid:<9}{child.spec.address:<22}"
                         f"{child.spec.metrics_url}")
        lines.append("Ctrl-C stops the stack.")
        print("\n".join(lines), flush=True)

    # ---- shutdown ------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        signals_before = self.num_signals
        deadline = time.monotonic() + self.stop_timeout_s
        for kinds in STOP_STAGES:
            stage = [child for child in self.children if child.spec.kind in kinds]
            for child in stage:
                child.terminate()
            while any(child.alive() for child in stage):
                if time.monotonic() > deadline or self.num_signals > signals_before:
                    break
                time.sleep(POLL_S / 2)
        stragglers = [child for child in self.children if child.alive()]
        for child in stragglers:
            say(f"{child.name} did not stop in time; killing it")
            child.kill()
        for child in self.children:
            child.kill_group()

    def _publish(self, status: str) -> None:
        if self.state_path is not None:
            restarts = {name: state.total_restarts for name, state in self.restarts.items()}
            write_state(self.state_path, stack_state(status, self.topology, self.children,
                                                     self.ready, restarts))


def say(message: str) -> None:
    print(f"[kvrelay up] {message}", flush=True)


def indent(text: str) -> str:
    return "\n".join(f"    | {line}" for line in text.splitlines())


def _probe(spec: ServiceSpec) -> HealthProbe:
    return HealthProbe(spec.address, spec.rest_url, spec.tls_dir, spec.tls_role)
