"""`kvrelay up`'s plan: ports, roles and command lines of each topology (no processes started)."""
from __future__ import annotations

import argparse

import pytest

from kvrelay.stack import main as stack_main
from kvrelay.stack.plan import num_internal_ports, plan_stack


def parse(*argv: str, env: dict[str, str] | None = None, monkeypatch=None) -> argparse.Namespace:
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    stack_main.add_arguments(parser)
    return parser.parse_args(list(argv))


def flag(spec, name: str) -> str:
    return spec.argv[spec.argv.index(name) + 1]


def test_pd_plan_has_one_prefill_and_one_decode_worker_on_distinct_ports():
    specs = plan_stack(parse("--base-port", "40000"))
    assert [s.name for s in specs] == ["tokenizer", "scheduler", "prefill-0", "decode-0", "gateway"]
    assert [s.role for s in specs if s.kind == "worker"] == ["prefill", "decode"]
    internal = [s for s in specs if s.kind != "gateway"]
    gateway = specs[-1]
    ports = [int(flag(s, "--port")) for s in internal] + \
            [int(flag(s, "--metrics-port")) for s in [*internal, gateway]]
    assert sorted(ports) == list(range(40000, 40000 + len(ports)))
    assert len(ports) == num_internal_ports(parse())
    assert gateway.metrics_url == f"http://127.0.0.1:{40000 + len(ports) - 1}/metrics"
    assert flag(gateway, "--port") == "8000" and gateway.address == "127.0.0.1:50050"
    assert flag(gateway, "--tokenizer-address") == specs[0].address
    assert flag(gateway, "--scheduler-address") == specs[1].address


def test_workers_advertise_their_own_address_and_wait_for_tokenizer_and_scheduler():
    specs = plan_stack(parse("--host", "0.0.0.0", "--threads-per-worker", "3"))
    for worker in (s for s in specs if s.kind == "worker"):
        assert flag(worker, "--advertise-address") == worker.address
        assert worker.address.startswith("127.0.0.1:")  # a wildcard bind is dialled on loopback
        assert flag(worker, "--host") == "0.0.0.0"
        assert flag(worker, "--scheduler-address") == specs[1].address
        assert flag(worker, "--num-threads") == "3" and worker.env["OMP_NUM_THREADS"] == "3"
        assert set(worker.depends_on) == {"tokenizer", "scheduler"}


def test_colocated_plan_runs_one_worker_with_role_both():
    specs = plan_stack(parse("--topology", "colocated"))
    workers = [s for s in specs if s.kind == "worker"]
    assert [(w.name, flag(w, "--role")) for w in workers] == [("worker-0", "both")]


def test_engine_flags_reach_only_the_services_that_own_them():
    specs = {s.name: s for s in plan_stack(parse(
        "--dtype", "float32", "--num-kv-blocks", "1024", "--no-prefix-caching",
        "--max-num-batched-tokens", "512", "--api-key", "k"))}
    assert flag(specs["decode-0"], "--dtype") == "float32"
    assert flag(specs["prefill-0"], "--num-kv-blocks") == "1024"
    assert "--no-prefix-caching" in specs["scheduler"].argv
    assert flag(specs["scheduler"], "--max-num-batched-tokens") == "512"
    assert flag(specs["gateway"], "--api-key") == "k"
    assert "--dtype" not in specs["tokenizer"].argv  # unset flags keep each service's default
    assert "--model" not in specs["decode-0"].argv


def test_vnni_kernel_flags_reach_the_workers_only():
    specs = {s.name: s for s in plan_stack(parse("--q4a8-max-tokens", "16", "--int8-activations"))}
    for name in ("prefill-0", "decode-0"):
        assert flag(specs[name], "--q4a8-max-tokens") == "16"
        assert "--int8-activations" in specs[name].argv
    for name in ("scheduler", "gateway", "tokenizer"):
        assert "--int8-activations" not in specs[name].argv
        assert "--q4a8-max-tokens" not in specs[name].argv
    defaults = {s.name: s for s in plan_stack(parse())}["decode-0"].argv
    assert "--int8-activations" not in defaults and "--q4a8-max-tokens" not in defaults


def test_the_chat_template_reaches_every_tokenizer_as_an_absolute_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a relative path, as a user types it
    specs = plan_stack(parse("--chat-template", "tools.jinja", "--tokenizers", "2"))
    tokenizers = [s for s in specs if s.kind == "tokenizer"]
    assert len(tokenizers) == 2
    for spec in tokenizers:
        assert flag(spec, "--chat-template") == str(tmp_path / "tools.jinja")
    assert all("--chat-template" not in s.argv for s in specs if s.kind != "tokenizer")
    assert all("--chat-template" not in s.argv for s in plan_stack(parse()))


def test_up_flags_from_env_are_not_inherited_by_children(monkeypatch):
    # KVRELAY_PORT means the REST port to `up` but the gRPC port to the tokenizer.
    args = parse(env={"KVRELAY_PORT": "9000", "KVRELAY_LEASE_MS": "500"},
                 monkeypatch=monkeypatch)
    assert args.port == 9000
    env = stack_main._child_env(args)
    assert "KVRELAY_PORT" not in env and env["KVRELAY_LEASE_MS"] == "500"


@pytest.mark.parametrize("argv", [("--port", "50052"), ("--grpc-port", "8000"),
                                  ("--num-decode-workers", "0"),
                                  # a pipeline across hosts is one worker's
                                  ("--nnodes", "2", "--pipeline-parallel-size", "2",
                                   "--decode-workers", "2"),
                                  ("--nnodes", "2", "--pipeline-parallel-size", "2",
                                   "--topology", "colocated", "--num-workers", "2"),
                                  # the decoder's pipeline cannot be placed on the hosts
                                  ("--nnodes", "2", "--pipeline-parallel-size", "2"),
                                  ("--nnodes", "2", "--pipeline-parallel-size", "3",
                                   "--dist-init-address", "10.0.0.1:29500"),
                                  ("--dist-init-address", "10.0.0.1:29500")])
def test_conflicting_ports_and_empty_topologies_are_refused(argv):
    assert stack_main._check_args(parse(*argv)) is not None


def test_groups_have_their_own_scheduler_and_workers_behind_every_gateway():
    args = parse("--groups", "2", "--gateways", "2", "--prefill-workers", "2",
                 "--decode-workers", "2", "--base-port", "41000", "--port", "8100")
    specs = {s.name: s for s in plan_stack(args)}
    schedulers = [specs["scheduler-0"], specs["scheduler-1"]]
    for group, scheduler in enumerate(schedulers):
        workers = [s for name, s in specs.items() if name.startswith(f"g{group}-")]
        assert sorted(flag(w, "--role") for w in workers) == ["decode"] * 2 + ["prefill"] * 2
        for worker in workers:
            assert flag(worker, "--scheduler-address") == scheduler.address
            assert scheduler.name in worker.depends_on
    every_group = ",".join(s.address for s in schedulers)
    for index in range(2):
        gateway = specs[f"gateway-{index}"]
        assert flag(gateway, "--scheduler-address") == every_group
        assert flag(gateway, "--port") == str(8100 + index)
        assert flag(gateway, "--grpc-port") == str(50050 + index)
    internal = [s for s in specs.values() if s.kind != "gateway"]
    ports = [int(flag(s, "--port")) for s in internal] + \
            [int(flag(s, "--metrics-port")) for s in specs.values()]
    assert sorted(ports) == list(range(41000, 41000 + num_internal_ports(args)))


def test_structured_output_flags_reach_the_scheduler():
    specs = {s.name: s for s in plan_stack(parse(
        "--model", "/models/x", "--structured-outputs-backend", "xgrammar"))}
    assert flag(specs["scheduler"], "--model") == "/models/x"  # its tokenizer compiles grammars
    assert flag(specs["scheduler"], "--structured-outputs-backend") == "xgrammar"
    assert "--structured-outputs-backend" not in specs["decode-0"].argv


def test_scheduling_and_recovery_flags_reach_the_scheduler_only():
    specs = {s.name: s for s in plan_stack(parse(
        "--prefill-max-num-batched-tokens", "2048", "--worker-wait-timeout", "15",
        "--request-timeout", "30", "--tokenizer-wait-timeout", "5"))}
    assert flag(specs["gateway"], "--request-timeout") == "30.0"
    assert flag(specs["gateway"], "--tokenizer-wait-timeout") == "5.0"
    assert flag(specs["scheduler"], "--prefill-max-num-batched-tokens") == "2048"
    assert flag(specs["scheduler"], "--worker-wait-timeout") == "15.0"
    for name in ("prefill-0", "decode-0", "gateway", "tokenizer"):
        assert "--worker-wait-timeout" not in specs[name].argv
    defaults = {s.name: s for s in plan_stack(parse())}
    assert "--prefill-max-num-batched-tokens" not in defaults["scheduler"].argv


def test_no_async_scheduling_reaches_the_scheduler_only():
    specs = {s.name: s for s in plan_stack(parse("--no-async-scheduling"))}
    assert "--no-async-scheduling" in specs["scheduler"].argv
    for name in ("prefill-0", "decode-0", "gateway", "tokenizer"):
        assert "--no-async-scheduling" not in specs[name].argv
    assert "--no-async-scheduling" not in {s.name: s for s in plan_stack(parse())}["scheduler"].argv


def test_a_pipeline_across_hosts_takes_this_hosts_share_of_the_threads():
    args = parse("--topology", "colocated", "--pipeline-parallel-size", "4", "--nnodes", "2",
                 "--dist-init-address", "10.0.0.1:29500", "--threads-per-worker", "8")
    assert stack_main._check_args(args) is None
    [worker] = [s for s in plan_stack(args) if s.kind == "worker"]
    assert flag(worker, "--nnodes") == "2" and flag(worker, "--num-threads") == "4"
    assert flag(worker, "--dist-init-address") == "10.0.0.1:29500"


def test_a_pd_stacks_decode_worker_spans_the_hosts_and_its_prefill_worker_does_not():
    args = parse("--decode-pipeline-parallel-size", "2", "--nnodes", "2",
                 "--dist-init-address", "10.0.0.1:29500")
    assert stack_main._check_args(args) is None
    workers = {s.name: s for s in plan_stack(args) if s.kind == "worker"}
    assert flag(workers["decode-0"], "--nnodes") == "2"
    assert flag(workers["decode-0"], "--dist-init-address") == "10.0.0.1:29500"
    assert flag(workers["prefill-0"], "--nnodes") == "1"
    assert "--dist-init-address" not in workers["prefill-0"].argv
