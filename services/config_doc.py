"""docs/configuration.md, generated from the code: every service's flags and `kvrelay up`'s (as
their flags modules declare them) and the environment switches (common/env_switches.py).

    python -m kvrelay.config_doc --out docs/configuration.md     (make docs)

tests/test_config_doc.py fails when the committed file differs from what this writes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrelay.common.env_switches import SWITCHES, EnvSwitch
from kvrelay.common.flags import FlagDeclaration, declared_flags, env_name
from kvrelay.stack import main as stack_main
from kvrelay.stack.passthrough import SERVICE_FLAGS, service_flags

HEADER = """# Configuration

Generated from the code by `python -m kvrelay.config_doc --out docs/configuration.md` (`make
docs`); a test fails when this file is stale, so edit the flags' declarations (each service's
`flags.py`, `services/stack/main.py`) or `services/common/env_switches.py`, not this file.

Every flag `--some-flag` is also read from `KVRELAY_SOME_FLAG`; the command line wins. The same
names configure the local stack, docker compose and Kubernetes. `kvrelay up` reads its own
variables and passes the values on its children's command lines (they do not inherit them).
A default left blank means none (the service decides, as the text says).
"""


def render() -> str:
    sections = [HEADER]
    for service in SERVICE_FLAGS:
        sections.append(_flag_table(f"kvrelay {service}", service_flags(service)))
    sections.append(_flag_table("kvrelay up", declared_flags(stack_main.add_arguments),
                                "The flags below that a service also has are that service's "
                                "own declarations, passed on to it when set."))
    sections.append(_switch_table(SWITCHES.values()))
    return "\n".join(sections)


def _flag_table(title: str, flags: dict[str, FlagDeclaration], intro: str = "") -> str:
    lines = [f"## `{title}`", ""]
    if intro:
        lines += [intro, ""]
    lines += ["| flag | environment | default | what it does |", "|---|---|---|---|"]
    for flag, declaration in flags.items():
        kwargs = declaration.kwargs
        names = ", ".join(f"`{name}`" for name in (flag, *declaration.aliases))
        lines.append(f"| {names} | `{env_name(flag)}` | {_default(kwargs)} | "
                     f"{_cell(_description(kwargs))} |")
    return "\n".join(lines) + "\n"


def _default(kwargs: dict) -> str:
    if kwargs.get("action") == "store_true":
        return "off"
    default = kwargs.get("default")
    return "" if default is None else f"`{default}`"


def _description(kwargs: dict) -> str:
    text = kwargs.get("help", "").replace("%%", "%")  # argparse's escape for a literal %
    choices = kwargs.get("choices")
    if choices:
        text = f"{text} One of: {', '.join(map(str, choices))}.".strip()
    return text


def _switch_table(switches) -> str:
    lines = ["## Environment switches", "",
             "Read by the code itself, not through a flag; an on/off switch is on unless set "
             "to `0`.", "",
             "| variable | type | default | read by | what it does |", "|---|---|---|---|---|"]
    for switch in switches:
        lines.append(f"| `{switch.name}` | {switch.type} | `{switch.default}` | "
                     f"{_reader(switch)} | {_cell(switch.help)} |")
    return "\n".join(lines) + "\n"


def _reader(switch: EnvSwitch) -> str:
    return "Python" if switch.read_in == "python" else f"`{switch.read_in}`"


def _cell(text: str) -> str:
    """Help text as one markdown table cell: pipes would end it, <word> would vanish as HTML."""
    for raw, escaped in (("|", "\\|"), ("<", "&lt;"), ("*", "\\*"), ("\n", " ")):
        text = text.replace(raw, escaped)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrelay.config_doc", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="write here (default: stdout)")
    args = parser.parse_args(argv)
    text = render()
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
