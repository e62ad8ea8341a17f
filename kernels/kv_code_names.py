"""--kv-cache-dtype's values, apart from kv_quant.py so that flags and configs read them without
loading torch: the model's dtype ("auto") or 8-bit codes with a scale per cache row."""

CODE_NAMES = ("int8", "fp8_e4m3", "fp8_e5m2")
# vLLM's names for the same formats
ALIASES = {"fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3"}
CHOICES = ("auto", *CODE_NAMES, *ALIASES)


def canonical(name: str) -> str:
    """The value as kvrelay names it ("fp8" -> "fp8_e4m3"); ValueError for an unknown one."""
    name = ALIASES.get(name, name)
    if name != "auto" and name not in CODE_NAMES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(CHOICES)}")
    return name
