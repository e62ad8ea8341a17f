"""The adapters a server (or an offline LLM) knows by name: name -> (id, path).

Ids come from one counter and are never reused, so a name unloaded and loaded again (perhaps
with other weights) is a new adapter everywhere an id keys something: the prefix cache, the
workers' slots. Bounded: `max_adapters` names at a time.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True, slots=True)
class AdapterRef:
    adapter_id: int
    name: str
    path: str


class AdapterCatalog:
    def __init__(self, max_adapters: int = 64) -> None:
        self.max_adapters = max_adapters
        self.by_name: dict[str, AdapterRef] = {}
        self._ids = itertools.count(1)

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def get(self, name: str) -> AdapterRef | None:
        return self.by_name.get(name)

    def refs(self) -> list[AdapterRef]:
        return list(self.by_name.values())

    def check_new(self, name: str, reserved_names: frozenset[str] = frozenset()) -> None:
        """Raise ValueError where `name` cannot be registered now (taken, malformed, full)."""
        if not isinstance(name, str) or not NAME.match(name):
            raise ValueError("an adapter name is 1-128 characters: letters, digits and ._:/@+- "
                             "(not first)")
        if name in self.by_name or name in reserved_names:
            raise ValueError(f"the name {name!r} is already in use")
        if len(self.by_name) >= self.max_adapters:
            raise ValueError(f"{self.max_adapters} adapters are loaded, the most this server "
                             "holds; unload one first")

    def next_id(self) -> int:
        """A fresh id, to load an adapter under before it is added."""
        return next(self._ids)

    def add(self, name: str, path: str, adapter_id: int | None = None) -> AdapterRef:
        """Register `name` (check_new first), under adapter_id (from next_id) or a fresh id."""
        ref = AdapterRef(self.next_id() if adapter_id is None else adapter_id, name, path)
        self.by_name[name] = ref
        return ref

    def remove(self, name: str) -> AdapterRef:
        """KeyError where no adapter has the name."""
        return self.by_name.pop(name)
