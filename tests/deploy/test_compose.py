"""docker-compose.yml and its monitoring files: the services, commands, variables, healthchecks
and scrape targets match the CLI; `docker-compose config -q` where it is installed."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy import cli_facts

REPO = cli_facts.REPO
KVRELAY = {"tokenizer": "tokenizer", "scheduler": "scheduler", "prefill-worker": "worker",
           "decode-worker": "worker", "gateway": "gateway"}  # compose service -> subcommand


def load_compose(text: str | None = None) -> dict:
    return yaml.safe_load(text if text is not None else (REPO / "docker-compose.yml").read_text())


def env(service: dict) -> dict[str, str | None]:
    raw = service.get("environment", {})
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return {key: None if value is None else str(value) for key, value in raw.items()}


def port_of(command: str, service: dict, env_name: str) -> int:
    """A port flag's value in this service: its variable, else the flag's default."""
    value = env(service).get(env_name)
    return int(value) if value is not None else cli_facts.flag_default(command, env_name)


def grpc_port(command: str, service: dict) -> int:
    return port_of(command, service, "KVRELAY_GRPC_PORT" if command == "gateway" else
                   "KVRELAY_PORT")


def compose_problems(compose: dict) -> list[str]:
    """What is wrong with a compose file's kvrelay services (empty: nothing)."""
    problems = []
    services = compose.get("services", {})
    for name, command in KVRELAY.items():
        service = services.get(name)
        if service is None:
            problems.append(f"{name}: missing")
            continue
        if not service.get("image", "").startswith("kvrelay") or "build" not in service:
            problems.append(f"{name}: not built from this repository's image")
        if cli_facts.subcommand(service.get("command", [])) != command:
            problems.append(f"{name}: does not run `kvrelay {command}`")
            continue
        for unknown in cli_facts.unknown_envs(command, env(service)):
            problems.append(f"{name}: {unknown} is not a flag of `kvrelay {command}`")
        test = service.get("healthcheck", {}).get("test", [])
        if command == "gateway":
            # Its gRPC port is public (no internal mutual TLS): /health on its metrics port.
            probe = (f"urlopen('http://127.0.0.1:"
                     f"{port_of(command, service, 'KVRELAY_METRICS_PORT')}/health'")
            if test[:3] != ["CMD", "python", "-c"] or probe not in " ".join(test[3:]):
                problems.append(f"{name}: healthcheck does not probe HTTP /health ({probe})")
        else:
            probe = f"127.0.0.1:{grpc_port(command, service)}"
            if test[:4] != ["CMD", "python", "-m", "kvrelay.common.healthcheck"] or \
                    probe not in test:
                problems.append(f"{name}: healthcheck does not probe gRPC health on {probe}")
        for key, value in env(service).items():
            if key.endswith("_ADDRESS") and key != "KVRELAY_ADVERTISE_ADDRESS" and value:
                for host, port in cli_facts.addresses(value):
                    target = services.get(host)
                    target_command = KVRELAY.get(host)
                    if target is None or target_command is None or port != grpc_port(
                            target_command, target):
                        problems.append(f"{name}: {key} {host}:{port} is no service's gRPC port")
        if command == "worker":
            if "container_name" in service or service.get("ports"):
                problems.append(f"{name}: a fixed container name or host port stops --scale")
            if env(service).get("KVRELAY_ROLE") != name.split("-")[0]:
                problems.append(f"{name}: KVRELAY_ROLE is not {name.split('-')[0]}")
            if env(service).get("KVRELAY_KV_TRANSPORTS") != "grpc":
                problems.append(f"{name}: containers share no /dev/shm; KV transports must be grpc")
        if service.get("profiles"):
            problems.append(f"{name}: in a profile, so a plain `up` would not start it")
    return problems


def test_compose_services_match_the_cli():
    assert compose_problems(load_compose()) == []


def test_start_order_waits_for_health():
    services = load_compose()["services"]
    for worker in ("prefill-worker", "decode-worker"):
        assert services[worker]["depends_on"] == {"scheduler": {"condition": "service_healthy"}}
    assert services["gateway"]["depends_on"] == {
        "tokenizer": {"condition": "service_healthy"},
        "scheduler": {"condition": "service_healthy"}}
    drain_s = cli_facts.flag_default("worker", "KVRELAY_DRAIN_TIMEOUT")
    for name in ("scheduler", "prefill-worker", "decode-worker", "gateway"):
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) > drain_s, name


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c["services"]["gateway"]["environment"].update(KVRELAY_SCHEDULER_ADRESS="x"),
     "KVRELAY_SCHEDULER_ADRESS is not a flag of `kvrelay gateway`"),
    (lambda c: c["services"]["tokenizer"]["environment"].update(KVRELAY_ROLE="decode"),
     "KVRELAY_ROLE is not a flag of `kvrelay tokenizer`"),
    (lambda c: c["services"]["decode-worker"].update(container_name="decode"), "--scale"),
    (lambda c: c["services"]["scheduler"]["healthcheck"].update(
        test=["CMD", "python", "-m", "kvrelay.common.healthcheck", "127.0.0.1:50051"]),
     "scheduler: healthcheck"),
    (lambda c: c["services"]["gateway"]["environment"].update(
        KVRELAY_TOKENIZER_ADDRESS="tokenizer:50052"), "tokenizer:50052 is no service's gRPC"),
    (lambda c: c["services"]["prefill-worker"]["environment"].update(
        KVRELAY_KV_TRANSPORTS="grpc,shm"), "KV transports must be grpc"),
    (lambda c: c["services"]["scheduler"].update(command=["schedular"]), "kvrelay scheduler`"),
    (lambda c: c["services"]["gateway"]["environment"].update(KVRELAY_METRICS_PORT="9200"),
     "gateway: healthcheck does not probe HTTP /health"),
    (lambda c: c["services"].pop("tokenizer"), "tokenizer: missing"),
])
def test_compose_check_catches(edit, expected):
    compose = load_compose()
    edit(compose)
    problems = compose_problems(compose)
    assert any(expected in problem for problem in problems), problems


def test_monitoring_profile_scrapes_every_service():
    compose = load_compose()
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name].get("volumes", []):
            source = volume.split(":")[0]
            assert (REPO / source).exists(), f"{name} mounts missing {source}"
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {}
    for job in config["scrape_configs"]:
        static = [target for group in job.get("static_configs", [])
                  for target in group["targets"]]
        dns = [f"{name}:{sd['port']}" for sd in job.get("dns_sd_configs", [])
               for name in sd["names"]]
        jobs[job["job_name"]] = static + dns
    for name, command in KVRELAY.items():
        # Every service, the gateway included, serves /metrics on its --metrics-port.
        port = port_of(command, services[name], "KVRELAY_METRICS_PORT")
        assert jobs[name] == [f"{name}:{port}"], name


def test_grafana_provisioning_points_at_the_mounts():
    grafana = load_compose()["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    dashboards = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/kvrelay.yml").read_text())
    path = dashboards["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/dashboards"] == path
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].startswith(path)
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    sources = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert sources["datasources"][0]["url"] == "http://prometheus:9090"


def test_gpu_override():
    """docker-compose.gpu.yml merged over the base (environment maps merge, the rest is
    added): still valid, and each worker reserves a GPU and runs on CUDA."""
    compose = load_compose()
    override = yaml.safe_load((REPO / "docker-compose.gpu.yml").read_text())
    assert set(override["services"]) == {"prefill-worker", "decode-worker"}
    for name, extra in override["services"].items():
        service = compose["services"][name]
        service["environment"] = {**service["environment"], **extra["environment"]}
        service["deploy"] = extra["deploy"]
        assert env(service)["KVRELAY_DEVICE"] == "cuda"
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] == 1
    assert compose_problems(compose) == []


@pytest.mark.skipif(shutil.which("docker-compose") is None,
                    reason="docker-compose is not installed (Debian package docker-compose)")
def test_docker_compose_config():
    gpu = ["-f", "docker-compose.yml", "-f", "docker-compose.gpu.yml"]
    for options in ([], ["--profile", "monitoring"], gpu):
        done = subprocess.run(["docker-compose", *options, "config", "-q"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr


TLS_ROLE = {"tokenizer": "tokenizer", "scheduler": "scheduler", "prefill-worker": "worker",
            "decode-worker": "worker", "gateway": "gateway"}  # compose service -> cert role


def test_every_service_gets_the_ca_and_its_own_roles_certificate():
    """Mutual TLS through compose secrets: each service mounts the CA, the CRL and its own
    role's certificate and key (no other role's key), and names them with KVRELAY_TLS_*; the
    files are those `kvrelay certs` writes, in KVRELAY_CERTS_DIR."""
    compose = load_compose()
    secrets = compose["secrets"]
    files = {name: secret["file"] for name, secret in secrets.items()}
    prefix = "${KVRELAY_CERTS_DIR:-./deploy/certs}/"
    assert all(path.startswith(prefix) for path in files.values()), files
    for name, role in TLS_ROLE.items():
        service = compose["services"][name]
        mounted = {secret if isinstance(secret, str) else secret["source"]
                   for secret in service["secrets"]}
        variables = env(service)
        expected = {"CA": "ca.pem", "CRL": "crl.pem", "CERT": f"{role}.pem",
                    "KEY": f"{role}-key.pem"}
        for kind, filename in expected.items():
            path = variables[f"KVRELAY_TLS_{kind}"]
            assert path.startswith("/run/secrets/"), (name, kind, path)
            secret = path.removeprefix("/run/secrets/")
            assert secret in mounted and files[secret] == prefix + filename, (name, kind)
        keys = {files[secret] for secret in mounted if files[secret].endswith("-key.pem")}
        assert keys == {prefix + f"{role}-key.pem"}, (name, keys)
        assert cli_facts.flag_envs(KVRELAY[name]) >= {
            f"KVRELAY_TLS_{kind}" for kind in expected}, name
