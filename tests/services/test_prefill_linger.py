"""A prefill worker's wait for more prompts while it shares its cores with running decodes
(services/scheduler/prefill_linger.py), on a real ClusterScheduler (no gRPC, no model)."""
import asyncio
import time

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.prefill_linger import linger_s
from services.scheduler.step_gate import OWN_CORES
from services.scheduler.worker_link import WorkerLink
from tests.services.cluster_driver import DECODE, PREFILL, ClusterDriver, prompt, worker_info

DOMAIN = "host-a/cpus:0,1"
LINGER = {"shared_prefill_linger_ms": 200.0, "shared_prefill_linger_tokens": 64}


def _pair(scheduler_config: dict, decode_domain: str = DOMAIN) -> ClusterDriver:
    return ClusterDriver([worker_info("p0", PREFILL, 64, 1024, DOMAIN, 2),
                          worker_info("d0", DECODE, 64, 1024, decode_domain, 2)],
                         scheduler_config=scheduler_config)


def _decoding(scheduler_config: dict = LINGER, decode_domain: str = DOMAIN) -> ClusterDriver:
    """d0 decodes one sequence, p0 has nothing queued."""
    driver = _pair(scheduler_config, decode_domain)
    driver.submit("first", prompt(20), max_tokens=50)
    assert linger_s(driver.cluster, driver.worker("p0"), time.monotonic()) == 0  # no decodes yet
    driver.step("p0")
    driver.deliver_sends()
    driver.step("d0")
    assert driver.worker("d0").core.running
    return driver


def _wait(driver: ClusterDriver, now: float | None = None) -> float:
    return linger_s(driver.cluster, driver.worker("p0"), time.monotonic() if now is None else now)


def test_a_lone_short_prompt_waits_until_the_oldest_has_waited_the_linger():
    driver = _decoding()
    before = time.monotonic()
    driver.submit("second", prompt(30, first=20), max_tokens=5)
    arrived = driver.worker("p0").core.waiting.peek().arrival_time
    assert before <= arrived
    assert _wait(driver, arrived) == pytest.approx(0.2)
    assert _wait(driver, arrived + 0.15) == pytest.approx(0.05)
    assert _wait(driver, arrived + 0.2) == 0  # waited long enough: it steps
    # a younger prompt does not move the deadline: the oldest sets it
    driver.submit("third", prompt(20, first=60), max_tokens=5)
    assert _wait(driver, arrived + 0.1) == pytest.approx(0.1)


def test_enough_queued_tokens_end_the_wait_at_once():
    driver = _decoding()
    driver.submit("second", prompt(30, first=20), max_tokens=5)
    assert _wait(driver) > 0
    driver.submit("third", prompt(40, first=60), max_tokens=5)  # 70 tokens >= 64
    assert _wait(driver) == 0


def test_no_wait_without_running_decodes_on_the_same_cores():
    driver = _pair(LINGER)  # d0 has nothing running
    driver.submit("only", prompt(30), max_tokens=5)
    assert _wait(driver) == 0
    elsewhere = _decoding(decode_domain="host-b/cpus:0,1")  # decodes on other hardware
    elsewhere.submit("second", prompt(30, first=20), max_tokens=5)
    assert _wait(elsewhere) == 0


def test_no_wait_when_switched_off_or_part_way_through_a_prompt():
    off = _decoding({})  # the default: 0 ms
    off.submit("second", prompt(30, first=20), max_tokens=5)
    assert _wait(off) == 0
    chunked = _decoding({**LINGER, "shared_prefill_linger_tokens": 1000})
    chunked.submit("long", prompt(300, first=20), max_tokens=5)
    assert _wait(chunked) > 0
    chunked.step("p0")  # the budget (256) takes part of it: the rest is running, not waiting
    p0 = chunked.worker("p0").core
    assert p0.running and not p0.waiting
    assert _wait(chunked) == 0


def test_a_prompt_that_waited_still_gets_its_first_token():
    """Lingering only delays the step: once the wait is over the prompt prefills, hands off and
    decodes to the end, and nothing is left behind."""
    driver = _decoding()
    driver.submit("second", prompt(30, first=20), max_tokens=5)
    assert _wait(driver) > 0
    assert _wait(driver, time.monotonic() + 1.0) == 0
    driver.run()
    driver.check_deltas(ended=True)
    assert len(driver.tokens("second")) == 5 and len(driver.tokens("first")) == 50
    assert not driver.has_work("p0") and not driver.has_work("d0")


def test_the_step_loop_wakes_itself_when_the_wait_ends():
    """WorkerLink: a lingering prefill link sets a timer for the end of the wait, and the
    next check (new work woke it) replaces that timer instead of stacking another."""
    driver = _decoding()
    driver.submit("second", prompt(30, first=20), max_tokens=5)

    async def scenario():
        link = WorkerLink(driver.cluster, driver.worker("p0"), OWN_CORES)
        link.wakeup.clear()
        assert link._linger()
        first_timer = link.linger_timer
        assert link._linger()  # checked again before the end: one timer, the new one
        assert first_timer.cancelled() and not link.linger_timer.cancelled()
        assert not link.wakeup.is_set()
        await asyncio.wait_for(link.wakeup.wait(), timeout=2.0)  # ~0.2 s: the wait's end
        assert not link._linger() and link.linger_timer is None  # now it steps

    asyncio.run(scenario())


@pytest.mark.parametrize("bad", [{"shared_prefill_linger_ms": -1.0},
                                 {"shared_prefill_linger_ms": 20_000.0},
                                 {"shared_prefill_linger_tokens": 0}])
def test_bad_linger_settings_are_refused(bad):
    with pytest.raises(ValueError, match="shared_prefill_linger"):
        SchedulerConfig(**bad)
