"""CoreShare: how workers on the same cores get their steps' turns and thread counts, driven
on a real ClusterScheduler (no gRPC, no model)."""
import asyncio
from dataclasses import replace

from hypothesis import given, settings, strategies as st

from kvrelay.scheduler.core_share import CoreShare, domain_cpus
from tests.services.cluster_driver import DECODE, PREFILL, ClusterDriver, prompt, worker_info

DOMAIN = "host-a/cpus:0,1"


def _pair(num_threads: int = 2) -> ClusterDriver:
    return ClusterDriver([worker_info("p0", PREFILL, 64, 1024, DOMAIN, num_threads),
                          worker_info("d0", DECODE, 64, 1024, DOMAIN, num_threads)])


def _decoding_pair() -> ClusterDriver:
    """d0 decodes one sequence; p0 has a prompt queued: both have work."""
    driver = _pair()
    driver.submit("first", prompt(20), max_tokens=50)
    driver.step("p0")
    driver.deliver_sends()
    driver.submit("second", prompt(30, first=20), max_tokens=5)
    assert driver.has_work("p0") and driver.has_work("d0")
    return driver


def _share(driver: ClusterDriver, split: bool) -> CoreShare:
    share = CoreShare(split, num_cpus=domain_cpus(DOMAIN), has_work=driver.cluster.has_work)
    for worker_id in ("p0", "d0"):
        share.join(driver.worker(worker_id))
    return share


async def _enter(share: CoreShare, worker, log: list, name: str, exit_event: asyncio.Event):
    async with share.turn(worker) as num_threads:
        log.append((name, num_threads))
        await exit_event.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _turns_at_once(share: CoreShare, driver: ClusterDriver) -> list:
    """p0 and d0 ask for a turn together: the turns granted before either step ends, as
    (worker, thread count) pairs."""
    async def scenario():
        log, release = [], asyncio.Event()
        tasks = [asyncio.create_task(_enter(share, driver.worker(w), log, w, release))
                 for w in ("p0", "d0")]
        await _settle()
        at_once = sorted(log)
        release.set()
        await asyncio.gather(*tasks)
        assert share.held == {}
        return at_once
    return asyncio.run(scenario())


def test_serialized_steps_take_turns_with_every_core():
    async def scenario():
        driver = _decoding_pair()
        share = _share(driver, split=False)
        log, release_p, release_d = [], asyncio.Event(), asyncio.Event()
        p = asyncio.create_task(_enter(share, driver.worker("p0"), log, "p0", release_p))
        d = asyncio.create_task(_enter(share, driver.worker("d0"), log, "d0", release_d))
        await _settle()
        assert log == [("p0", 0)]  # d0 waits for its turn although it has work
        release_p.set()
        await _settle()
        assert log == [("p0", 0), ("d0", 0)]
        release_d.set()
        await asyncio.gather(p, d)
        assert share.held == {}
    asyncio.run(scenario())


def test_split_steps_run_side_by_side_on_a_core_each_while_both_workers_have_work():
    driver = _decoding_pair()
    assert _turns_at_once(_share(driver, split=True), driver) == [("d0", 1), ("p0", 1)]


def test_a_decode_worker_that_speculates_is_not_split_off():
    from kvrelay.engine.spec.config import SpeculativeConfig
    from kvrelay.engine.spec.drafter import Drafter

    driver = _decoding_pair()
    driver.worker("d0").core.drafter = Drafter(SpeculativeConfig(disable_by_batch_size=4))
    # its verify steps are compute-bound: the steps take turns with every core instead
    assert _turns_at_once(_share(driver, split=True), driver) == [("p0", 0)]
    # above disable_by_batch_size it decodes plainly again, and splits
    driver.worker("d0").core.drafter = Drafter(SpeculativeConfig(disable_by_batch_size=1))
    assert _turns_at_once(_share(driver, split=True), driver) == [("d0", 1), ("p0", 1)]


def test_a_burst_of_prompts_takes_every_core_until_it_is_through():
    """More prompts await a first token than sequences decode: the prefill worker's steps
    take every core in turn (prefill_chunks.py), until at most one prompt is left."""
    driver = _decoding_pair()
    for index in range(4):
        driver.submit(f"burst-{index}", prompt(100, first=100 + 110 * index), max_tokens=5)
    # 5 prompts and 1 decode: the prompts go first from the burst's very first step
    assert _turns_at_once(_share(driver, split=True), driver) == [("p0", 0)]
    driver.step("p0")  # 430 tokens, 256 a step: the rest waits for the next
    assert driver.worker("p0").core.prompts_first
    assert _turns_at_once(_share(driver, split=True), driver) == [("p0", 0)]
    driver.step("p0")  # the rest of the burst: nothing is left
    assert not driver.worker("p0").core.prompts_first
    driver.submit("lone", prompt(30, first=400), max_tokens=5)
    assert _turns_at_once(_share(driver, split=True), driver) == [("d0", 1), ("p0", 1)]


def test_a_split_step_takes_every_core_while_the_other_worker_has_nothing_to_do():
    async def scenario():
        driver = _pair()
        driver.submit("only", prompt(20), max_tokens=5)  # queued on p0; d0 holds nothing
        assert not driver.has_work("d0")
        share = _share(driver, split=True)
        log, release = [], asyncio.Event()
        await asyncio.wait_for(asyncio.create_task(
            _enter(share, driver.worker("p0"), log, "p0", _set(release))), 1)
        assert log == [("p0", 0)]
    asyncio.run(scenario())


def test_a_worker_that_gets_work_during_a_whole_core_step_waits_then_splits():
    async def scenario():
        driver = _pair()
        driver.submit("first", prompt(20), max_tokens=50)
        share = _share(driver, split=True)
        log, release_p, release_d = [], asyncio.Event(), asyncio.Event()
        p = asyncio.create_task(_enter(share, driver.worker("p0"), log, "p0", release_p))
        await _settle()
        assert log == [("p0", 0)]  # alone with work: both cores
        driver.step("p0")  # (the step itself, in the driver) its sequence goes to d0
        driver.deliver_sends()
        driver.submit("second", prompt(30, first=20), max_tokens=5)
        d = asyncio.create_task(_enter(share, driver.worker("d0"), log, "d0", release_d))
        await _settle()
        assert log == [("p0", 0)]  # the cores are taken until p0's step ends
        release_p.set()
        await _settle()
        assert log == [("p0", 0), ("d0", 1)]  # p0 still has work: d0 gets its share
        p = asyncio.create_task(_enter(share, driver.worker("p0"), log, "p0", asyncio.Event()))
        await _settle()
        assert log[-1] == ("p0", 1)  # and p0's next step runs beside d0's
        p.cancel()
        release_d.set()
        await asyncio.gather(d, p, return_exceptions=True)
        assert share.held == {}
    asyncio.run(scenario())


def test_a_cancelled_waiter_holds_no_cores_and_blocks_nobody():
    async def scenario():
        driver = _decoding_pair()
        share = _share(driver, split=False)
        log, release = [], asyncio.Event()
        p = asyncio.create_task(_enter(share, driver.worker("p0"), log, "p0", release))
        await _settle()
        d = asyncio.create_task(_enter(share, driver.worker("d0"), log, "d0", release))
        await _settle()
        d.cancel()  # e.g. its worker died while it waited for its turn
        await asyncio.gather(d, return_exceptions=True)
        assert [w for w, _ in share.waiting] == []
        release.set()
        await p
        assert share.held == {}
        await asyncio.wait_for(_enter(share, driver.worker("d0"), log, "d0", release), 1)
        assert log[-1] == ("d0", 0)
    asyncio.run(scenario())


def test_workers_whose_threads_fit_the_cpus_together_step_at_once_in_any_mode():
    for split in (False, True):
        driver = _decoding_pair()  # 2 threads each
        share = CoreShare(split, num_cpus=domain_cpus("host-a/cpus:0,1,2,3"),
                          has_work=driver.cluster.has_work)
        for worker_id in ("p0", "d0"):
            share.join(driver.worker(worker_id))
        # both at once, on all their threads
        assert _turns_at_once(share, driver) == [("d0", 0), ("p0", 0)]


def test_workers_on_one_gpu_take_turns_even_when_split_is_asked_for():
    driver = _decoding_pair()
    share = CoreShare(split=True, num_cpus=domain_cpus("host-a/cuda:GPU-1234"),
                      has_work=driver.cluster.has_work)
    for worker_id in ("p0", "d0"):
        share.join(driver.worker(worker_id))
    assert _turns_at_once(share, driver) == [("p0", 0)]


def test_a_domain_counts_the_cpus_it_names():
    assert domain_cpus("boot-1/cpus:0,1") == 2
    assert domain_cpus("boot-1/cpus:0,1,2,3,4,5,6,7/own:pod-a") == 8
    assert domain_cpus("boot-1/cuda:GPU-1234") is None


def test_workers_that_report_no_thread_count_use_every_cpu_and_take_turns():
    driver = _decoding_pair()
    for worker_id in ("p0", "d0"):
        worker = driver.worker(worker_id)
        worker.info = replace(worker.info, num_threads=0)  # an older worker
    assert _turns_at_once(_share(driver, split=True), driver) == [("p0", 0)]


def _set(event: asyncio.Event) -> asyncio.Event:
    event.set()
    return event


def test_split_applies_only_while_a_long_prompt_prefills():
    def turns(prompt_length: int) -> list:
        driver = _pair()
        driver.submit("first", prompt(20), max_tokens=50)
        driver.step("p0")
        driver.deliver_sends()
        driver.submit("next", prompt(prompt_length, first=20), max_tokens=5)
        share = CoreShare(split=True, long_prompt_tokens=64, num_cpus=2,
                          has_work=driver.cluster.has_work)
        share.join(driver.worker("p0"))
        share.join(driver.worker("d0"))
        return _turns_at_once(share, driver)

    # A short prompt (a burst's) prefills on every core, in turn with the decodes.
    assert turns(64) == [("p0", 0)]
    # A long one prefills on one core while the decodes go on, on the other.
    assert turns(65) == [("d0", 1), ("p0", 1)]

def test_a_prompt_whose_prefix_is_cached_is_as_long_as_what_is_left_of_it():
    def turns(second_prompt: list[int]) -> list:
        driver = _pair()
        driver.submit("first", prompt(100), max_tokens=50)  # its 6 full blocks stay cached
        driver.step("p0")
        driver.deliver_sends()
        driver.submit("second", second_prompt, max_tokens=5)
        share = CoreShare(split=True, long_prompt_tokens=64, num_cpus=2,
                          has_work=driver.cluster.has_work)
        share.join(driver.worker("p0"))
        share.join(driver.worker("d0"))
        return _turns_at_once(share, driver)

    # 120 tokens, 96 of them cached: 24 to compute, a short prompt's turn with every core
    assert turns(prompt(100) + prompt(20, first=500)) == [("p0", 0)]
    # the same length with nothing cached is long: split
    assert turns(prompt(120, first=300)) == [("d0", 1), ("p0", 1)]


# ---- random schedules ----------------------------------------------------------------------
WORKERS = ("p0", "d0", "p1")


@given(ops=st.lists(st.tuples(st.sampled_from(["ask", "end", "cancel", "work", "idle"]),
                              st.sampled_from(WORKERS)), max_size=40),
       split=st.booleans(), num_cpus=st.integers(1, 4),
       threads=st.tuples(*[st.integers(0, 4)] * len(WORKERS)))
@settings(max_examples=300, deadline=None)
def test_random_schedules_never_oversubscribe_never_idle_a_fitting_waiter_and_drain(
        ops, split, num_cpus, threads):
    """Workers ask for turns, end or abandon them, gain and lose work in any order: the steps
    running never hold more CPUs than the domain has, nor more threads than their worker has;
    the first waiter is never left waiting while its share is free; and once every step has
    ended, nothing is held or waiting."""
    domain = f"host-a/cpus:{','.join(map(str, range(num_cpus)))}"
    driver = ClusterDriver([worker_info(w, DECODE if w == "d0" else PREFILL, 64, 1024, domain,
                                        n) for w, n in zip(WORKERS, threads)])
    driver.submit("long", prompt(100), max_tokens=5)  # queued on a prefill worker: long
    busy: set[str] = set()  # workers given work beyond the long prompt ("work" below)
    share = CoreShare(split, long_prompt_tokens=64, num_cpus=num_cpus,
                      has_work=lambda w: w.worker_id in busy or driver.cluster.has_work(w))
    for worker_id in WORKERS:
        share.join(driver.worker(worker_id))
    asyncio.run(_play(share, driver, ops, busy))


async def _play(share: CoreShare, driver: ClusterDriver, ops, busy: set[str]) -> None:
    turns: dict[str, tuple[asyncio.Task, asyncio.Event]] = {}
    granted: dict[str, int] = {}  # worker -> thread count of its running step

    async def take_turn(worker_id: str, end: asyncio.Event) -> None:
        worker = driver.worker(worker_id)
        async with share.turn(worker) as num_threads:
            granted[worker_id] = num_threads
            own = share.own(worker)
            assert 0 <= num_threads < own or num_threads == 0
            await end.wait()
        granted.pop(worker_id)

    for op, worker_id in ops:
        worker = driver.worker(worker_id)
        task = turns.get(worker_id)
        if op == "ask" and (task is None or task[0].done()):
            end = asyncio.Event()
            turns[worker_id] = (asyncio.create_task(take_turn(worker_id, end)), end)
        elif op == "end" and task is not None:
            task[1].set()
        elif op == "cancel" and task is not None:
            task[0].cancel()  # its worker died, waiting or stepping
        elif op == "work":  # as the service does when a worker gets work
            busy.add(worker_id)
            share.refresh()
        elif op == "idle":
            busy.discard(worker_id)
        await _settle()
        assert sum(share.held.values()) <= share.capacity
        if share.waiting:  # work-conserving: the head waits only while its share is taken
            head = share.waiting[0][0]
            assert share.capacity - sum(share.held.values()) < share._share(head)
    for task, end in turns.values():
        end.set()
    await asyncio.gather(*(task for task, _ in turns.values()), return_exceptions=True)
    await _settle()
    assert share.held == {} and not share.waiting


def test_a_worker_waiting_for_a_turn_makes_the_holder_stop_planning_ahead():
    """Serialized: d0 holds the cores; once p0 asks, d0's step loop sends no step ahead, so
    p0 waits for one step at most (worker_link.py)."""
    driver = _decoding_pair()
    share = _share(driver, split=False)
    decode, prefill = driver.worker("d0"), driver.worker("p0")

    async def scenario():
        log, release = [], asyncio.Event()
        holder = asyncio.create_task(_enter(share, decode, log, "d0", release))
        await _settle()
        alone = share.contended(decode)
        waiter = asyncio.create_task(_enter(share, prefill, log, "p0", asyncio.Event()))
        await _settle()
        contended = (share.contended(decode), share.contended(prefill))
        release.set()
        await holder
        waiter.cancel()
        return alone, contended

    alone, (for_decode, for_prefill) = asyncio.run(scenario())
    assert not alone and for_decode and not for_prefill
