"""Typed records that cross module boundaries.

Data flows one way: config -> scheduler -> canary -> ProbeRecord -> verdict -> collector.
Everything here is plain data (no IO), so every stage can be tested with hand-built records.
The closed sets (Verdict, Cause, ErrorReason, Phase, Tier) are the only values the exporter ever
puts in a label, which is what keeps label cardinality bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from enum import Enum

from hicache_canary.settings.target_knobs import PROBE_KNOBS


class Verdict(str, Enum):
    REUSED = "reused"
    SILENT = "silent"
    NOT_EVICTED = "not_evicted"
    # Evicted, but no tier evidence and a latency signal too weak to call (short cold prefill,
    # or a ratio between the bands): saying "silent" here would wake someone for nothing.
    INCONCLUSIVE = "inconclusive"
    DEVICE_CACHE_BROKEN = "device_cache_broken"
    HICACHE_DISABLED = "hicache_disabled"
    SKIPPED_BUSY = "skipped_busy"
    SKIPPED_BUDGET = "skipped_budget"
    ERROR = "error"

    @property
    def conclusive(self) -> bool:
        """A verdict that says something about HiCache itself (not about the probe)."""
        return self in (Verdict.REUSED, Verdict.SILENT, Verdict.DEVICE_CACHE_BROKEN, Verdict.HICACHE_DISABLED)


class Cause(str, Enum):
    """Suspected cause of a `silent` verdict; see docs/runbooks/HiCacheSilent.md."""

    MAMBA_STATE_NOT_BACKED_UP = "mamba_state_not_backed_up"
    CHUNKED_PREFILL_NOT_BACKED_UP = "chunked_prefill_not_backed_up"
    HOST_POOL_PRESSURE = "host_pool_pressure"
    LOAD_BACK_SKIPPED = "load_back_skipped"
    UNKNOWN = "unknown"
    NONE = "none"  # the verdict is not silent


class ErrorReason(str, Enum):
    """Why a probe ended in `error`. Never an exception text: those are unbounded."""

    CONNECT_FAILED = "connect_failed"  # no connection could be made (refused, DNS, connect timeout)
    CONNECTION_LOST = "connection_lost"  # the server dropped an open connection mid-request
    TIMEOUT = "timeout"
    HTTP_5XX = "http_5xx"
    RATE_LIMITED = "rate_limited"
    HTTP_4XX = "http_4xx"
    UNAUTHORIZED = "unauthorized"
    BAD_RESPONSE = "bad_response"
    SERVER_RESTARTED = "server_restarted"
    TARGET_IS_ROUTER = "target_is_router"
    CONTEXT_TOO_LONG = "context_too_long"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class Phase(str, Enum):
    # A short request before R on a server that has served nothing yet: a fresh SGLang's first
    # request compiles kernels (live 0.5.17: 10.2 s for 16 tokens), which must not land in R's cold.
    WARMUP = "warmup"
    COLD = "cold"
    # write_through_selective only: R once more right after cold (a device hit), so R reaches the
    # backup threshold of 2 hits as any returning context would. Never a latency label value.
    PRIME = "prime"
    PRESSURE = "pressure"
    REHOST = "rehost"
    AGAIN = "again"


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


# Per-target knobs of one probe (built from the validated config by config_target.py). The fields,
# their types and defaults come from the knob table, target_knobs.KNOBS, so each is written once.
ProbeSettings = make_dataclass(
    "ProbeSettings",
    [("target", str), *((k.attr, k.type, field(default=k.default)) for k in PROBE_KNOBS)],
    frozen=True,
)
ProbeSettings.__module__ = __name__  # pickled to and from the probe worker by reference
ProbeSettings.__doc__ = "Per-target knobs of one probe: " + ", ".join(
    f"{k.attr} ({k.doc or k.key})" for k in PROBE_KNOBS
)


@dataclass(frozen=True)
class CachedTokens:
    """`meta_info.cached_tokens_details` of one request (or `sglext.cached_tokens_details`)."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


@dataclass(frozen=True)
class GenerateResult:
    """What one `/generate` (or `/v1/completions`) call told us."""

    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # meta_info.cached_tokens; None when the server did not say
    details: CachedTokens | None  # None when the server gave no per-tier breakdown
    request_id: str | None = None


@dataclass(frozen=True)
class CounterSnapshot:
    """SGLang's own counters at one instant, aggregated the way SGLang emits them.

    Every field is None when its family is absent from /metrics (older release, never
    incremented yet, metrics disabled): absence is information, not zero.
    Dict-valued fields are keyed by the label that distinguishes children
    (`pool`, `mode`, `cache_source`, `reason`); an unlabelled family (0.5.17) is keyed "".
    """

    taken_at: float = 0.0
    host_used_tokens: float | None = None
    host_total_tokens: float | None = None
    host_mamba_used_states: float | None = None
    host_mamba_total_states: float | None = None
    backup_tokens: dict[str, float] | None = None  # hicache_backup_tokens_total{pool}
    load_back_tokens: dict[str, float] | None = None  # load_back_tokens_total{pool}
    evicted_tokens: float | None = None  # evicted_tokens_total
    dropped_tokens: dict[str, float] | None = None  # hicache_dropped_tokens_total{reason}
    prefill_effective_tokens: dict[str, float] | None = None  # {mode}
    cached_tokens: dict[str, float] | None = None  # cached_tokens_total{cache_source}
    prompt_tokens: float | None = None  # prompt_tokens_total (all children summed)
    num_running_reqs: float | None = None
    num_queue_reqs: float | None = None
    kv_available_tokens: float | None = None
    kv_evictable_tokens: float | None = None
    # Device slots in use: running requests, and nodes locked while their write-through is in flight
    # (a live 0.5.17 holds a fresh R here until the scheduler runs again).
    num_used_tokens: float | None = None
    max_total_num_tokens: float | None = None
    process_start_time: float | None = None  # restarts show as a change here or as counter drops
    families: frozenset[str] = frozenset()  # family names seen, without the "sglang:" prefix
    parse_errors: tuple[str, ...] = ()  # one short line per garbled line or family


@dataclass(frozen=True)
class ServerFacts:
    """What `/server_info` says about the server that matters to a probe."""

    version: str | None = None
    model_path: str | None = None
    served_model_name: str | None = None
    enable_hierarchical_cache: bool = False
    write_policy: str | None = None
    page_size: int = 1
    chunked_prefill_size: int | None = None
    max_total_num_tokens: int | None = None
    max_req_input_len: int | None = None
    context_length: int | None = None
    speculative_algorithm: str | None = None
    hybrid_model: bool = False
    dp_size: int = 1
    tp_size: int = 1
    enable_cache_report: bool = False
    enable_metrics: bool = False
    looks_like_router: bool = False


@dataclass
class StepRecord:
    """One step of a probe: the request we sent and the counters around it."""

    phase: Phase
    latency_s: float | None = None
    prompt_tokens: int = 0  # tokens sent in this step (sum over chunks for pressure)
    requests: int = 0
    cached: CachedTokens | None = None
    cached_tokens: int | None = None
    before: CounterSnapshot | None = None
    after: CounterSnapshot | None = None


@dataclass
class PressureRecord:
    planned_tokens: int = 0  # what LRU needed, before counting the server's own traffic
    synthetic_tokens: int = 0  # filler we actually sent
    passive_tokens: int = 0  # the server's own traffic credited towards eviction
    chunks: int = 0
    eviction_confirmed: bool = False
    limited_by: str | None = None  # e.g. "max_pressure_tokens" when a limit cut it short


@dataclass
class ProbeRecord:
    """Everything one probe did and saw. The verdict fields are filled by verdict.decide()."""

    target: str
    started_at: float
    finished_at: float | None = None
    context_tokens: int = 0
    api: str = "native"  # "native" (/generate) or "openai" (/v1/completions)
    server: ServerFacts | None = None
    steps: list[StepRecord] = field(default_factory=list)
    pressure: PressureRecord = field(default_factory=PressureRecord)
    verdict: Verdict | None = None
    cause: Cause = Cause.NONE
    reason: ErrorReason | None = None
    evidence: str = ""  # one sentence, shown to people; never exported as a label
    host_fraction: float | None = None  # rehost host-cached tokens / R's cacheable tokens
    rehost_cold_ratio: float | None = None

    def step(self, phase: Phase) -> StepRecord | None:
        for s in self.steps:
            if s.phase == phase:
                return s
        return None

    @property
    def tokens_canary(self) -> int:
        return sum(s.prompt_tokens for s in self.steps if s.phase != Phase.PRESSURE)

    @property
    def tokens_pressure(self) -> int:
        return self.pressure.synthetic_tokens
