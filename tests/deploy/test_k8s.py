"""k8s/: every rendered manifest validates against Kubernetes' schema, and the objects fit
together (see k8s_checks.py), in the base, both overlays and the examples (two groups, tensor
parallel, pipeline parallel in a pod and across two nodes)."""
from __future__ import annotations

import copy
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

from kvrelay.common.certs import write_bundle
from tests.deploy import cli_facts
from tests.deploy.k8s_checks import (all_problems, containers, ingress_sources, kubectl, of_kind,
                                     pod_templates, raw_resources, render, schema_problems)

K8S = cli_facts.REPO / "k8s"
RENDERED = ["base", "overlays/cpu", "overlays/gpu", "examples/two-groups",
            "examples/tensor-parallel", "examples/pipeline-parallel",
            "examples/pipeline-two-nodes"]
COMPONENT = "app.kubernetes.io/component"
GROUP = "kvrelay.io/group"
WORKERS = ("prefill-worker", "decode-worker")

needs_kubectl = pytest.mark.skipif(
    kubectl() is None, reason="kubectl is not installed, so the kustomizations cannot be rendered "
    "(`kubectl kustomize`); test_raw_resources_validate still checks every resource file")


@functools.cache
def k8s_with_certs() -> Path:
    """A copy of k8s/ with the TLS files the base's Secrets are generated from (`kvrelay certs
    --out k8s/base/tls`, which a user runs before applying; never committed)."""
    copy_root = Path(tempfile.mkdtemp(prefix="kvrelay-k8s-")) / "k8s"
    shutil.copytree(K8S, copy_root, ignore=shutil.ignore_patterns("tls"))
    write_bundle(copy_root / "base" / "tls", roles=("gateway", "tokenizer", "scheduler", "worker"))
    return copy_root


@functools.cache
def rendered(name: str) -> list[dict]:
    return render(k8s_with_certs() / name)


def rendered_copy(name: str) -> list[dict]:
    return copy.deepcopy(rendered(name))


def by_component(docs: list[dict], kind: str, component: str) -> list[dict]:
    return [doc for doc in of_kind(docs, kind)
            if doc["metadata"].get("labels", {}).get(COMPONENT) == component]


def env_of(container: dict, docs: list[dict]) -> dict[str, object]:
    """The container's variables, envFrom ConfigMaps resolved."""
    env = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(next(doc for doc in of_kind(docs, "ConfigMap")
                        if doc["metadata"]["name"] == name)["data"])
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


# ---- without kustomize --------------------------------------------------------------------------
def test_raw_resources_validate():
    """Every resource file the kustomizations list validates as written (no kubectl needed)."""
    problems, count = [], 0
    for name in RENDERED + ["group"]:
        for path, doc in raw_resources(K8S / name):
            count += 1
            problems += [f"{path.relative_to(K8S)}: {p}" for p in schema_problems(doc)]
    assert count > 20
    assert problems == []


def test_kustomization_files_exist():
    """Every file a kustomization.yaml names (resources, patches) is there."""
    for kustomization in K8S.rglob("kustomization.yaml"):
        config = yaml.safe_load(kustomization.read_text())
        paths = config.get("resources", []) + [p["path"] for p in config.get("patches", [])]
        for entry in paths:
            assert (kustomization.parent / entry).exists(), f"{kustomization}: {entry}"


# ---- rendered -----------------------------------------------------------------------------------
@needs_kubectl
@pytest.mark.parametrize("name", RENDERED)
def test_rendered_validates_against_schema(name):
    docs = rendered(name)
    problems = [problem for doc in docs for problem in schema_problems(doc)]
    assert problems == []
    assert {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"} == {
        "kvrelay"}


@needs_kubectl
@pytest.mark.parametrize("name", RENDERED)
def test_rendered_cross_references(name):
    assert all_problems(rendered(name)) == []


@needs_kubectl
@pytest.mark.parametrize("name", RENDERED)
def test_components(name):
    docs = rendered(name)
    for component in ("gateway", "tokenizer", "scheduler") + WORKERS:
        # a worker whose pipeline spans nodes is a StatefulSet (a pod a node)
        kinds = ("Deployment", "StatefulSet") if component in WORKERS else ("Deployment",)
        deployments = [doc for kind in kinds for doc in by_component(docs, kind, component)]
        assert deployments, component
        for deployment in deployments:
            command = cli_facts.subcommand(
                deployment["spec"]["template"]["spec"]["containers"][0]["args"])
            assert command == ("worker" if component in WORKERS else component)
    for scheduler in by_component(docs, "Deployment", "scheduler"):
        assert scheduler["spec"]["replicas"] == 1  # one engine core per group
    for component in WORKERS:  # headless: one DNS record per worker pod
        for service in by_component(docs, "Service", component):
            assert service["spec"]["clusterIP"] == "None"
    assert {doc["spec"]["scaleTargetRef"]["name"] for doc in of_kind(
        docs, "HorizontalPodAutoscaler")} == {"gateway", "tokenizer"}
    assert all(doc["apiVersion"] == "autoscaling/v2"
               for doc in of_kind(docs, "HorizontalPodAutoscaler"))
    budgets = {doc["metadata"]["labels"][COMPONENT] for doc in of_kind(docs,
                                                                       "PodDisruptionBudget")}
    assert budgets == {"gateway", "tokenizer", *WORKERS}


@needs_kubectl
@pytest.mark.parametrize("name", RENDERED)
def test_pods_probe_drain_and_settings(name):
    docs = rendered(name)
    drain_s = cli_facts.flag_default("worker", "KVRELAY_DRAIN_TIMEOUT")
    for _, template in pod_templates(docs):
        component = template["metadata"]["labels"][COMPONENT]
        spec = template["spec"]
        if component != "tokenizer":  # the others drain in-flight work on SIGTERM
            assert spec["terminationGracePeriodSeconds"] > drain_s, component
        for container in containers(template):
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= container.keys()
            # Readiness is the service's health on its metrics port, plain HTTP: the kubelet's
            # gRPC probe could not pass mutual TLS.
            assert container["readinessProbe"]["httpGet"] == {"path": "/health",
                                                              "port": "metrics"}, component
            # Mutual TLS on every internal hop, each pod with its role's certificate.
            role = "worker" if component in WORKERS else component
            tls_volume = next(v for v in spec["volumes"] if v["name"] == "tls")
            assert tls_volume["secret"]["secretName"].startswith(f"kvrelay-tls-{role}")
            assert {mount["mountPath"] for mount in container["volumeMounts"]} >= {
                "/etc/kvrelay/tls"}
            # The model loads before a worker is SERVING: its startup probe waits minutes.
            startup = container["startupProbe"]
            if component in WORKERS:
                assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
            # A read-only root filesystem, so /tmp (compiled kernels, caches) is a volume.
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert "/tmp" in {mount["mountPath"] for mount in container["volumeMounts"]}
            env = env_of(container, docs)
            assert (env["KVRELAY_TLS_CA"], env["KVRELAY_TLS_CERT"], env["KVRELAY_TLS_KEY"]) == (
                "/etc/kvrelay/tls/ca.crt", "/etc/kvrelay/tls/tls.crt", "/etc/kvrelay/tls/tls.key")
            if component in WORKERS:
                assert env["KVRELAY_ROLE"] == component.split("-")[0]
                assert env["KVRELAY_KV_TRANSPORTS"] == "grpc"  # pods share no /dev/shm
                assert env["KVRELAY_ADVERTISE_ADDRESS"] == "$(POD_IP):50060"
                assert container["env"][0] == {"name": "POD_IP", "valueFrom": {
                    "fieldRef": {"fieldPath": "status.podIP"}}}  # defined before it is used
            if component == "scheduler":
                assert env["KVRELAY_KV_TRANSPORT"] == "grpc"
            if component == "gateway":
                assert env["KVRELAY_API_KEY"] == {"secretKeyRef": {"name": env[
                    "KVRELAY_API_KEY"]["secretKeyRef"]["name"], "key": "api-key"}}
                assert env["KVRELAY_TOKENIZER_ADDRESS"].startswith("dns:///tokenizer-headless")


@needs_kubectl
@pytest.mark.parametrize("name", RENDERED)
def test_network_policies(name):
    """Only the gateway is open to the world; the workers only to schedulers and each other."""
    sources = ingress_sources(rendered(name), COMPONENT)
    scrape = "namespace:monitoring"
    assert sources["gateway"] == {"world", scrape}
    assert sources["tokenizer"] == {"gateway", scrape}
    assert sources["scheduler"] == {"gateway", *WORKERS, scrape}
    for component in WORKERS:
        assert sources[component] == {"scheduler", *WORKERS, scrape}


@needs_kubectl
def test_overlays_cpu_and_gpu():
    def workers_and_others(docs):
        workers, others = [], []
        for _, template in pod_templates(docs):
            (workers if template["metadata"]["labels"][COMPONENT] in WORKERS else others).append(
                template)
        return workers, others

    cpu = rendered("overlays/cpu")
    workers, others = workers_and_others(cpu)
    for template in workers + others:
        assert template["spec"]["containers"][0]["image"] == "kvrelay:cpu"
        assert "nvidia.com/gpu" not in str(template)
    for template in workers:
        container = template["spec"]["containers"][0]
        env = env_of(container, cpu)
        assert env["KVRELAY_DEVICE"] == "cpu"
        assert env["KVRELAY_NUM_THREADS"] == container["resources"]["requests"]["cpu"]

    gpu = rendered("overlays/gpu")
    workers, others = workers_and_others(gpu)
    for template in workers:
        container = template["spec"]["containers"][0]
        assert container["image"] == "kvrelay:gpu"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env_of(container, gpu)["KVRELAY_DEVICE"] == "cuda"
        assert container["startupProbe"]  # the patch merged into, not replaced, the container
    for template in others:
        assert "nvidia.com/gpu" not in str(template)


@needs_kubectl
def test_two_groups():
    docs = rendered("examples/two-groups")
    schedulers = sorted(doc["metadata"]["name"] for doc in by_component(docs, "Deployment",
                                                                       "scheduler"))
    assert schedulers == ["scheduler-0", "scheduler-1"]
    gateway = by_component(docs, "Deployment", "gateway")[0]["spec"]["template"]
    assert env_of(gateway["spec"]["containers"][0], docs)["KVRELAY_SCHEDULER_ADDRESS"] == (
        "scheduler-0:50052,scheduler-1:50052")
    for component in WORKERS:
        for deployment in by_component(docs, "Deployment", component):
            group = deployment["metadata"]["labels"][GROUP]
            template = deployment["spec"]["template"]
            assert template["metadata"]["labels"][GROUP] == group
            env = env_of(template["spec"]["containers"][0], docs)
            assert env["KVRELAY_SCHEDULER_ADDRESS"] == f"scheduler-{group}:50052"
    # Each group's Services select only that group's pods.
    for service in of_kind(docs, "Service"):
        labels = service["metadata"]["labels"]
        if GROUP in labels:
            assert service["spec"]["selector"][GROUP] == labels[GROUP]


# ---- the checks catch what they are for ---------------------------------------------------------
def _doc(docs, kind, name):
    return next(doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"]
                .startswith(name))


def _container(docs, name):
    return _doc(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def _break_service_selector(docs):
    _doc(docs, "Service", "tokenizer")["spec"]["selector"][COMPONENT] = "tokeniser"


def _break_target_port(docs):
    _doc(docs, "Service", "gateway")["spec"]["ports"][0]["targetPort"] = "rest"


def _break_probe_port(docs):
    _container(docs, "decode-worker")["livenessProbe"]["httpGet"]["port"] = 50099


def _break_env_name(docs):
    _container(docs, "gateway")["env"].append({"name": "KVRELAY_SCHEDULER_ADRESS", "value": "x"})


def _break_config_key_for_other_service(docs):
    _doc(docs, "ConfigMap", "kvrelay-worker")["data"]["KVRELAY_API_KEY"] = "x"


def _break_worker_command(docs):
    _container(docs, "scheduler")["args"] = ["schedular"]


def _break_secret_key(docs):
    _container(docs, "gateway")["env"][0]["valueFrom"]["secretKeyRef"]["key"] = "apikey"


def _break_config_map_name(docs):
    _container(docs, "tokenizer")["envFrom"][0]["configMapRef"]["name"] = "kvrelay-commons"


def _break_policy_peer(docs):
    policy = _doc(docs, "NetworkPolicy", "tokenizer")
    policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"][COMPONENT] = "gw"


def _break_policy_port(docs):
    _doc(docs, "NetworkPolicy", "workers")["spec"]["ingress"][0]["ports"][0]["port"] = 50061


def _break_address(docs):
    _doc(docs, "ConfigMap", "kvrelay-gateway")["data"]["KVRELAY_SCHEDULER_ADDRESS"] = (
        "scheduler-0:50052,scheduler-1:50052")


def _break_workload_selector(docs):
    _doc(docs, "Deployment", "gateway")["spec"]["selector"]["matchLabels"][COMPONENT] = "gw"


def _break_budget(docs):
    _doc(docs, "PodDisruptionBudget", "tokenizer")["spec"]["selector"]["matchLabels"][
        COMPONENT] = "tokeniser"


def _break_autoscaler(docs):
    _doc(docs, "HorizontalPodAutoscaler", "gateway")["spec"]["scaleTargetRef"]["name"] = "gw"


def _break_resources(docs):
    del _container(docs, "scheduler")["resources"]["requests"]["cpu"]


BROKEN = [
    (_break_service_selector, "Service/tokenizer: selector"),
    (_break_target_port, "targetPort rest is not a container port of Deployment/gateway"),
    (_break_probe_port, "livenessProbe port 50099 is not a container port"),
    (_break_env_name, "KVRELAY_SCHEDULER_ADRESS is not a flag of `kvrelay gateway`"),
    (_break_config_key_for_other_service, "KVRELAY_API_KEY is not a flag of `kvrelay worker`"),
    (_break_worker_command, "runs no kvrelay subcommand"),
    (_break_secret_key, "has no key apikey"),
    (_break_config_map_name, "ConfigMap kvrelay-commons is not defined"),
    (_break_policy_peer, "NetworkPolicy/tokenizer: peer"),
    (_break_policy_port, "port 50061 is not a container port of the pods it selects"),
    (_break_address, "scheduler-1:50052 is not a Service port"),
    (_break_workload_selector, "selector does not match its pod template labels"),
    (_break_budget, "PodDisruptionBudget/tokenizer: selects no pod template"),
    (_break_autoscaler, "scales Deployment/gw, which does not exist"),
    (_break_resources, "Deployment/scheduler-0/scheduler: no requests.cpu"),
]


@needs_kubectl
@pytest.mark.parametrize("breakage, expected", BROKEN, ids=[b.__name__ for b, _ in BROKEN])
def test_checks_catch_broken_manifests(breakage, expected):
    docs = rendered_copy("base")
    breakage(docs)
    problems = all_problems(docs)
    assert any(expected in problem for problem in problems), problems


@needs_kubectl
def test_schema_catches_unknown_and_missing_fields():
    docs = rendered_copy("base")
    _container(docs, "gateway")["imagePullPolcy"] = "Always"
    assert schema_problems(_doc(docs, "Deployment", "gateway"))
    service = _doc(docs, "Service", "gateway")
    del service["spec"]["ports"][0]["port"]
    assert schema_problems(service)


@needs_kubectl
def test_policy_check_sees_a_worker_opened_to_the_world():
    docs = rendered_copy("base")
    del _doc(docs, "NetworkPolicy", "workers")["spec"]["ingress"][0]["from"]
    assert "world" in ingress_sources(docs, COMPONENT)["decode-worker"]


@needs_kubectl
@pytest.mark.parametrize("example,variable", [
    ("tensor-parallel", "KVRELAY_TENSOR_PARALLEL_SIZE"),
    ("pipeline-parallel", "KVRELAY_PIPELINE_PARALLEL_SIZE")])
def test_split_decode_workers(example, variable):
    """A decode worker's group of 2 ranks (or pipeline of 2 stages) in its pod, CPUs for
    both, /dev/shm memory-backed for the cache file they share (every worker has it)."""
    docs = rendered(f"examples/{example}")
    for component in WORKERS:
        (deployment,) = by_component(docs, "Deployment", component)
        spec = deployment["spec"]["template"]["spec"]
        container = spec["containers"][0]
        ranks = {item["name"]: item.get("value") for item in container["env"]}.get(variable)
        assert ranks == ("2" if component == "decode-worker" else None)
        cpus = container["resources"]["requests"]["cpu"]
        assert cpus == ("8" if component == "decode-worker" else "4")
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["emptyDir"]["medium"] == "Memory"


@needs_kubectl
def test_a_decode_pipeline_across_two_nodes():
    """A StatefulSet of 2 pods a pipeline: each pod's node rank its index, both meeting at pod
    0's per-pod DNS name on the headless Service's rendezvous port, one pod a node, and every
    port open between the pipeline's own pods only (gloo picks its ports)."""
    docs = rendered("examples/pipeline-two-nodes")
    assert not by_component(docs, "Deployment", "decode-worker")
    (pipeline,) = by_component(docs, "StatefulSet", "decode-worker")
    spec = pipeline["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    container = spec["template"]["spec"]["containers"][0]
    env = env_of(container, docs)
    assert env["KVRELAY_NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    assert (env["KVRELAY_NNODES"], env["KVRELAY_PIPELINE_PARALLEL_SIZE"]) == ("2", "2")
    name = pipeline["metadata"]["name"]
    assert env["KVRELAY_DIST_INIT_ADDRESS"] == f"{name}-0.{spec['serviceName']}:29500"
    (service,) = [doc for doc in by_component(docs, "Service", "decode-worker")
                  if doc["metadata"]["name"] == spec["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    assert 29500 in [port["port"] for port in service["spec"]["ports"]]
    # pod 0 is Ready only once pod 1 joined it by name: the names resolve before readiness
    assert service["spec"]["publishNotReadyAddresses"] is True
    anti = spec["template"]["spec"]["affinity"]["podAntiAffinity"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == \
        "kubernetes.io/hostname"
    (policy,) = [doc for doc in of_kind(docs, "NetworkPolicy")
                 if doc["metadata"]["name"].startswith("decode-pipeline")]
    (rule,) = policy["spec"]["ingress"]
    assert "ports" not in rule  # every port
    assert rule["from"][0]["podSelector"]["matchLabels"] == \
        spec["selector"]["matchLabels"] == policy["spec"]["podSelector"]["matchLabels"]
