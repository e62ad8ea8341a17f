"""docs/configuration.md is what `python -m kvrelay.config_doc` writes from the code today, byte
for byte (`make docs` regenerates it), and it names every flag and environment switch."""
from __future__ import annotations

from pathlib import Path

from kvrelay import config_doc
from kvrelay.common.env_switches import SWITCHES
from kvrelay.common.flags import env_name
from kvrelay.stack.passthrough import SERVICE_FLAGS, service_flags

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_the_committed_configuration_doc_is_current():
    assert DOC.read_bytes() == config_doc.render().encode(), \
        "docs/configuration.md is stale: run `make docs`"


def test_the_doc_names_every_flag_variable_and_switch():
    text = config_doc.render()
    names = [env_name(flag) for service in SERVICE_FLAGS for flag in service_flags(service)]
    missing = [name for name in [*names, *SWITCHES] if f"`{name}`" not in text]
    assert not missing


def test_the_doc_does_not_depend_on_the_environment(monkeypatch):
    monkeypatch.setenv("KVRELAY_AMX_MAX_TOKENS", "7")
    monkeypatch.setenv("KVRELAY_NATIVE_GEMV", "0")
    assert config_doc.render().encode() == DOC.read_bytes()


def test_the_module_writes_the_file(tmp_path):
    out = tmp_path / "configuration.md"
    assert config_doc.main(["--out", str(out)]) == 0
    assert out.read_bytes() == DOC.read_bytes()
