"""Stop strings on streamed text: find them, cut them out, never release half of one."""
from __future__ import annotations


class StopStringMatcher:
    """Feeds one sample's text deltas; releases only text that cannot start a stop string.

    A tail of the text that is a prefix of some stop string is held back until the next delta
    shows whether it completes one; so a stop string is never split across deltas and never
    appears in the output."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self.held = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """Return (text to release now, the stop string that ends the sample or None)."""
        buffer = self.held + text
        hit = self._earliest_stop(buffer)
        if hit is not None:
            position, stop = hit
            self.held = ""
            return buffer[:position], stop
        keep = 0 if final else self._partial_stop_length(buffer)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], None

    def _earliest_stop(self, buffer: str) -> tuple[int, str] | None:
        found = [(buffer.find(stop), stop) for stop in self.stops if stop in buffer]
        return min(found) if found else None

    def _partial_stop_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that begins some stop string."""
        for length in range(min(len(buffer), max(map(len, self.stops)) - 1), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
