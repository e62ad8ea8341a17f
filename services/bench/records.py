"""What one benchmarked request measured: the unit every metric is computed from."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RequestRecord:
    index: int                    # position in the workload
    tag: str = ""
    sent_s: float = 0.0           # when it was sent, from the start of the run
    token_times_s: list[float] = field(default_factory=list)  # each content chunk, from send
    done_s: float | None = None   # end of the stream, from send (the e2e latency)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False  # False: output_tokens counts content chunks instead
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None and bool(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def itls_s(self) -> list[float]:
        """Gaps between successive chunks: a chunk is one token for kvrelay, vLLM and
        llama-server, so this is the inter-token latency as a client sees it."""
        times = self.token_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; undefined for one-token outputs."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.done_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return asdict(self)
