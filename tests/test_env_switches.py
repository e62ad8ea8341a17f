"""Every KVRELAY_* variable the sources read from the environment is declared once, in
kvrelay.common.env_switches (flags' KVRELAY_<FLAG> aside, which common/flags.py reads), and every
declared one is read. Read from the source text: the C++ kernels' getenv calls, and in Python
any environment read outside the two modules allowed to make them."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from kvrelay.common import env_switches

ROOT = Path(__file__).resolve().parent.parent
PYTHON_SOURCES = sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])
CPP_SOURCES = sorted(path for path in (ROOT / "kernels" / "csrc").iterdir()
                     if path.suffix in (".cpp", ".h"))
# the only modules that read KVRELAY_* variables themselves
READERS = {ROOT / "services" / "common" / "env_switches.py",
           ROOT / "services" / "common" / "flags.py"}
GETENV = re.compile(r'getenv\(\s*"(KVRELAY_\w+)"\s*\)')


def _cpp_reads() -> dict[str, set[str]]:
    """{variable: the C++ sources that getenv it}."""
    reads: dict[str, set[str]] = {}
    for path in CPP_SOURCES:
        for name in GETENV.findall(path.read_text()):
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return reads


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _environment_reads(tree: ast.AST):
    """(line, the first argument) of each os.environ.get/[]/setdefault and os.getenv."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if (func.attr in ("get", "setdefault", "pop") and _is_environ(func.value)) or \
                    func.attr == "getenv":
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.lineno, node.slice


def _foreign(argument: ast.AST) -> bool:
    """A literal name that is not kvrelay's (PATH, GOMP_SPINCOUNT)."""
    return (isinstance(argument, ast.Constant) and isinstance(argument.value, str)
            and not argument.value.startswith("KVRELAY_"))


def test_python_reads_kvrelay_variables_only_through_the_registry():
    stray = [f"{path.relative_to(ROOT)}:{line}"
             for path in PYTHON_SOURCES if path not in READERS
             for line, argument in _environment_reads(ast.parse(path.read_text()))
             if not _foreign(argument)]
    assert not stray, f"environment reads outside common/env_switches.py: {stray}"


def test_every_variable_the_cpp_reads_is_declared_with_its_reader():
    reads = _cpp_reads()
    assert reads, "the scan found no getenv in kernels/csrc"
    undeclared = sorted(set(reads) - set(env_switches.SWITCHES))
    assert not undeclared, f"declare these in common/env_switches.py: {undeclared}"
    for name, paths in reads.items():
        assert env_switches.SWITCHES[name].read_in in paths, name


def test_every_declared_switch_is_read():
    cpp = _cpp_reads()
    registry_names = {switch.name: attribute for attribute, switch in vars(env_switches).items()
                      if isinstance(switch, env_switches.EnvSwitch)}
    assert set(registry_names) == set(env_switches.SWITCHES)
    python_text = "\n".join(path.read_text() for path in PYTHON_SOURCES
                            if path not in READERS)
    unread = []
    for name, switch in env_switches.SWITCHES.items():
        if switch.read_in == env_switches.PYTHON:
            used = re.search(rf"\b{registry_names[name]}\b", python_text)
        else:
            used = name in cpp
        if not used:
            unread.append(name)
    assert not unread, f"declared but read nowhere: {unread}"


def test_an_on_off_switch_is_on_unless_zero(monkeypatch):
    switch = env_switches.NATIVE_GEMV
    monkeypatch.delenv(switch.name, raising=False)
    assert switch.enabled()
    monkeypatch.setenv(switch.name, "0")
    assert not switch.enabled()
    monkeypatch.setenv(switch.name, "1")
    assert switch.enabled()


def test_the_cache_directory_defaults_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv("KVRELAY_CACHE_DIR", raising=False)
    assert env_switches.CACHE_DIR.path() == Path.home() / ".cache" / "kvrelay"
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    assert env_switches.CACHE_DIR.path() == tmp_path
