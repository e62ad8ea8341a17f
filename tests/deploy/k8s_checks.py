"""Cross-reference checks over a list of rendered Kubernetes objects.

The schema says each object is well formed; these say the objects fit together: what a Service
selects exists and listens on its ports, probes hit real ports, every ConfigMap/Secret key used is
defined, every KVRELAY_* variable is a real flag of the service the container runs, addresses
point at Services that serve them, and policies select real pods. Each check returns a list of
problems (strings), empty when all is well, so tests can also feed them broken manifests.
"""
from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import yaml
from kubernetes_validate import utils as _kv_utils

from tests.deploy import cli_facts

K8S_VERSION = "1.32.0"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")

# kubernetes_validate re-reads its multi-megabyte definitions file on every call (~80 ms an
# object); the files never change, so read each once.
_kv_utils.schema_contents = functools.lru_cache(maxsize=None)(_kv_utils.schema_contents)


# ---- loading ------------------------------------------------------------------------------------
def load_docs(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def kubectl() -> str | None:
    return shutil.which("kubectl")


def render(path: Path) -> list[dict]:
    """`kubectl kustomize path` (kustomize built into kubectl; needs no cluster)."""
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, f"kubectl kustomize {path}: {done.stderr}"
    return load_docs(done.stdout)


def raw_resources(kustomization_dir: Path) -> list[tuple[Path, dict]]:
    """The objects of every resource file a kustomization lists, following directories, as
    written (no transformation): what can be checked without kustomize."""
    config = yaml.safe_load((kustomization_dir / "kustomization.yaml").read_text())
    found = []
    for entry in config.get("resources", []):
        path = (kustomization_dir / entry).resolve()
        if path.is_dir():
            found += raw_resources(path)
        else:
            found += [(path, doc) for doc in load_docs(path.read_text())]
    return found


def schema_problems(doc: dict) -> list[str]:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{_name(doc)}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"{_name(doc)}: no schema: {error}"]
    return []


# ---- helpers ------------------------------------------------------------------------------------
def _name(doc: dict) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def _ns(doc: dict) -> str:
    return doc.get("metadata", {}).get("namespace", "default")


def of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [doc for doc in docs if doc.get("kind") in kinds]


def pod_templates(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod template) for every workload."""
    return [(doc, doc["spec"]["template"]) for doc in of_kind(docs, *WORKLOADS)]


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels / matchExpressions) against a pod's labels."""
    if selector is None:
        return False
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get(
            "values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def selected_templates(docs: list[dict], namespace: str, selector: dict) -> list[tuple[dict, dict]]:
    return [(workload, template) for workload, template in pod_templates(docs)
            if _ns(workload) == namespace and selects(selector, template["metadata"].get(
                "labels", {}))]


def has_port(container: dict, port) -> bool:
    """`port` (number or name) is one of the container's ports."""
    for declared in container.get("ports", []):
        if port == declared["containerPort"] or port == declared.get("name"):
            return True
    return False


def _probe_port(probe: dict):
    for handler in ("grpc", "httpGet", "tcpSocket"):
        if handler in probe:
            return probe[handler]["port"]
    return None


def _container_envs(container: dict, docs: list[dict], namespace: str) -> dict[str, object]:
    """{name: value or reference} of every variable the container gets, envFrom included."""
    env = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        found = _find(docs, kind, ref["name"], namespace)
        for key, value in _data(found).items():
            env[source.get("prefix", "") + key] = value
    for item in container.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def _find(docs: list[dict], kind: str, name: str, namespace: str | None = None) -> dict | None:
    for doc in of_kind(docs, kind):
        if doc["metadata"]["name"] == name and (namespace is None or _ns(doc) == namespace):
            return doc
    return None


def _data(doc: dict | None) -> dict:
    if doc is None:
        return {}
    return {**doc.get("data", {}), **doc.get("stringData", {})}


# ---- checks -------------------------------------------------------------------------------------
def check_workload_selectors(docs: list[dict]) -> list[str]:
    """A workload's selector matches its own pod template (the API server rejects it otherwise,
    but the schema does not)."""
    return [f"{_name(workload)}: selector does not match its pod template labels"
            for workload, template in pod_templates(docs)
            if not selects(workload["spec"]["selector"], template["metadata"].get("labels", {}))]


def check_services(docs: list[dict]) -> list[str]:
    """Every Service selects pods, and each of its ports' targetPort is a port of every
    selected pod's containers."""
    problems = []
    for service in of_kind(docs, "Service"):
        selector = service["spec"].get("selector")
        if not selector:
            continue  # a Service without selector has hand-made endpoints
        matched = selected_templates(docs, _ns(service), {"matchLabels": selector})
        if not matched:
            problems.append(f"{_name(service)}: selector {selector} matches no pod template")
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for workload, template in matched:
                if not any(has_port(container, target) for container in containers(template)):
                    problems.append(f"{_name(service)}: targetPort {target} is not a container "
                                    f"port of {_name(workload)}")
    return problems


def check_probes(docs: list[dict]) -> list[str]:
    """Every probe's port is a port of its container."""
    problems = []
    for workload, template in pod_templates(docs):
        for container in containers(template):
            for kind in PROBES:
                if kind in container:
                    port = _probe_port(container[kind])
                    if port is None or not has_port(container, port):
                        problems.append(f"{_name(workload)}/{container['name']}: {kind} port "
                                        f"{port} is not a container port")
    return problems


def _missing(docs: list[dict], namespace: str, kind: str, ref: dict,
             key: str | None = None) -> str | None:
    """Why a reference to a ConfigMap/Secret (and key) does not resolve, or None."""
    if ref.get("optional"):
        return None
    found = _find(docs, kind, ref["name"], namespace)
    if found is None:
        return f"{kind} {ref['name']} is not defined"
    if key is not None and key not in _data(found):
        return f"{kind} {ref['name']} has no key {key}"
    return None


def check_config_refs(docs: list[dict]) -> list[str]:
    """Every ConfigMap/Secret (and key) that env, envFrom or a volume uses is defined."""
    problems = []
    for workload, template in pod_templates(docs):
        refs = []  # (kind, reference, key or None)
        for container in containers(template):
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    refs.append(("ConfigMap", source["configMapRef"], None))
                if "secretRef" in source:
                    refs.append(("Secret", source["secretRef"], None))
            for item in container.get("env", []):
                value_from = item.get("valueFrom", {})
                for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                    if field in value_from:
                        refs.append((kind, value_from[field], value_from[field]["key"]))
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                refs.append(("ConfigMap", volume["configMap"], None))
            if "secret" in volume:
                refs.append(("Secret", {"name": volume["secret"]["secretName"],
                                        **volume["secret"]}, None))
        for kind, ref, key in refs:
            problem = _missing(docs, _ns(workload), kind, ref, key)
            if problem:
                problems.append(f"{_name(workload)}: {problem}")
    return problems


def check_kvrelay_env(docs: list[dict]) -> list[str]:
    """Each kvrelay container runs a known subcommand, and every KVRELAY_* variable it gets
    (env or envFrom) sets a real flag of that subcommand (or is one the code reads directly)."""
    problems = []
    for workload, template in pod_templates(docs):
        for container in containers(template):
            if not container.get("image", "").split("/")[-1].startswith("kvrelay"):
                continue
            where = f"{_name(workload)}/{container['name']}"
            command = cli_facts.subcommand(container.get("command", []) + container.get("args", []))
            if command is None:
                problems.append(f"{where}: runs no kvrelay subcommand")
                continue
            env = _container_envs(container, docs, _ns(workload))
            for name in cli_facts.unknown_envs(command, env):
                problems.append(f"{where}: {name} is not a flag of `kvrelay {command}`")
    return problems


def check_addresses(docs: list[dict]) -> list[str]:
    """Every *_ADDRESS a kvrelay container dials (except the one it advertises) names a Service
    in its namespace with that port."""
    problems = []
    for workload, template in pod_templates(docs):
        for container in containers(template):
            env = _container_envs(container, docs, _ns(workload))
            for name, value in env.items():
                if not (name.endswith("_ADDRESS") and name != "KVRELAY_ADVERTISE_ADDRESS"
                        and isinstance(value, str)):
                    continue
                for host, port in cli_facts.addresses(value):
                    service = _find(docs, "Service", _service_of(host, docs, _ns(workload)),
                                    _ns(workload))
                    ports = [p["port"] for p in service["spec"]["ports"]] if service else []
                    if port not in ports:
                        problems.append(f"{_name(workload)}: {name} {host}:{port} is not a "
                                        "Service port in its namespace")
    return problems


def _service_of(host: str, docs: list[dict], namespace: str) -> str:
    """The Service a host name is: itself, or for a StatefulSet pod's own name
    ("<statefulset>-<index>.<service>") the governing Service, where such a pod exists."""
    pod, _, service = host.partition(".")
    workload_name, _, index = pod.rpartition("-")
    for workload in of_kind(docs, "StatefulSet"):
        if (_ns(workload) == namespace and workload["spec"].get("serviceName") == service
                and workload["metadata"]["name"] == workload_name and index.isdigit()
                and int(index) < workload["spec"].get("replicas", 1)):
            return service
    return host


def check_selectors_match_pods(docs: list[dict]) -> list[str]:
    """PodDisruptionBudgets, NetworkPolicies (and their pod peers) select real pods; every port
    a policy opens is a port of a pod it selects; HPAs scale workloads that exist."""
    problems = []
    for budget in of_kind(docs, "PodDisruptionBudget"):
        if not selected_templates(docs, _ns(budget), budget["spec"]["selector"]):
            problems.append(f"{_name(budget)}: selects no pod template")
    for policy in of_kind(docs, "NetworkPolicy"):
        namespace = _ns(policy)
        targets = selected_templates(docs, namespace, policy["spec"]["podSelector"])
        if not targets:
            problems.append(f"{_name(policy)}: podSelector selects no pod template")
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    if not selected_templates(docs, namespace, peer["podSelector"]):
                        problems.append(f"{_name(policy)}: peer {peer['podSelector']} selects "
                                        "no pod template")
            for port in rule.get("ports", []):
                if not any(has_port(container, port["port"]) for _, template in targets
                           for container in containers(template)):
                    problems.append(f"{_name(policy)}: port {port['port']} is not a container "
                                    "port of the pods it selects")
    for autoscaler in of_kind(docs, "HorizontalPodAutoscaler"):
        ref = autoscaler["spec"]["scaleTargetRef"]
        if _find(docs, ref["kind"], ref["name"], _ns(autoscaler)) is None:
            problems.append(f"{_name(autoscaler)}: scales {ref['kind']}/{ref['name']}, "
                            "which does not exist")
    return problems


def check_resources(docs: list[dict]) -> list[str]:
    """Every container requests CPU and memory and caps memory (the HPAs' CPU utilization is
    a fraction of the request; a pod without a memory limit can take a node's memory)."""
    problems = []
    for workload, template in pod_templates(docs):
        for container in containers(template):
            resources = container.get("resources", {})
            for section, name in (("requests", "cpu"), ("requests", "memory"),
                                  ("limits", "memory")):
                if name not in resources.get(section, {}):
                    problems.append(f"{_name(workload)}/{container['name']}: no {section}.{name}")
    return problems


CHECKS = (check_workload_selectors, check_services, check_probes, check_config_refs,
          check_kvrelay_env, check_addresses, check_selectors_match_pods, check_resources)


def all_problems(docs: list[dict]) -> list[str]:
    return [problem for check in CHECKS for problem in check(docs)]


# ---- who may reach whom -------------------------------------------------------------------------
def ingress_sources(docs: list[dict], component_label: str) -> dict[str, set[str]]:
    """{component: sources its policies admit}: other components' names, "world" for a rule
    open to every source, "namespace:<name>" for a namespace peer. A component no policy selects
    is open to the world (NetworkPolicy is allow-list only once a policy selects a pod)."""
    result = {}
    for _, template in pod_templates(docs):
        labels = template["metadata"].get("labels", {})
        component = labels.get(component_label)
        sources = set()
        selected = False
        for policy in of_kind(docs, "NetworkPolicy"):
            if not selects(policy["spec"]["podSelector"], labels):  # {} selects every pod
                continue
            selected = True
            for rule in policy["spec"].get("ingress", []):
                peers = rule.get("from", [])
                if not peers:
                    sources.add("world")
                for peer in peers:
                    if "ipBlock" in peer:
                        sources.add("world")
                    elif "namespaceSelector" in peer:
                        names = peer["namespaceSelector"].get("matchLabels", {})
                        sources.add("namespace:" + names.get("kubernetes.io/metadata.name", "*"))
                    else:
                        sources |= {other["metadata"]["labels"].get(component_label)
                                    for _, other in pod_templates(docs)
                                    if selects(peer["podSelector"], other["metadata"]["labels"])}
        result.setdefault(component, set()).update(sources if selected else {"world"})
    return result
