"""Resolved launch settings of one simulated SGLang server (what `/server_info` reports back).

Flag names follow SGLang's where SGLang has the flag. Host pool sizing follows SGLang's order:
an explicit token count (simulator-only), else `--hicache-size` GB per rank, else
`--hicache-ratio` x device pool (SGLang resolves the ratio to 2.0 when neither is given).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cache import HYBRID_FAILURES, WRITE_POLICIES

# Field report: host pool 11.6 GB/rank for 709,577 tokens (fp8 KV, TP=2) = ~16.3 KB per token per rank.
BYTES_PER_TOKEN = 16384
PROFILES = ("0.5.23", "0.5.17")


@dataclass(frozen=True)
class Faults:
    down_after: int | None = None  # stop serving after this many generate/completions requests
    rate_5xx: float = 0.0
    rate_429: float = 0.0
    slow_s: float = 0.0  # wall-clock seconds added to every generate/completions reply
    malformed_json: bool = False
    metrics_missing: bool = False  # /metrics loses the radix-cache and hicache families


@dataclass(frozen=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str = "Qwen3.8-27B-abliterated-AWQ-MTP"
    served_model_name: str = "Qwen3.8-27B-AWQ"
    tp_size: int = 1
    dp_size: int = 1
    page_size: int = 1
    max_total_tokens: int = 400000
    context_length: int = 262144
    chunked_prefill_size: int = 4096
    max_running_requests: int = 8
    enable_hierarchical_cache: bool = False
    hicache_write_policy: str = "write_through"
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_host_tokens: int | None = None
    hybrid_model: bool = False
    hybrid_failure: str = "mamba_state_not_backed_up"
    hicache_mamba_states: int | None = None
    max_mamba_cache_size: int = 15
    enable_metrics: bool = False
    enable_cache_report: bool = False
    api_key: str | None = None
    speculative_algorithm: str | None = None
    metrics_profile: str = "0.5.23"
    time_scale: float = 1.0
    # Live 0.5.17 (tests/testdata/sglang/sglang-0.5.17-live): a fresh server's 16-token first request took
    # 10.2 s, a first probe's cold 10.7 s against 0.24 s on the next probe: kernels compile on first use.
    warmup_seconds: float = 10.0
    latency_jitter: float = 0.0
    seed: int = 0
    background_rps: float = 0.0
    background_context_tokens: int = 2048
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        problems = []
        if self.hicache_write_policy not in WRITE_POLICIES:
            problems.append(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}")
        if self.hybrid_failure not in HYBRID_FAILURES:
            problems.append(f"--hybrid-failure must be one of {', '.join(HYBRID_FAILURES)}")
        if self.metrics_profile not in PROFILES:
            problems.append(f"--metrics-profile must be one of {', '.join(PROFILES)}")
        for name in ("max_total_tokens", "page_size", "chunked_prefill_size", "max_running_requests", "tp_size",
                     "context_length"):
            if getattr(self, name) < 1:
                problems.append(f"--{name.replace('_', '-')} must be at least 1")
        if self.time_scale <= 0:
            problems.append("--time-scale must be greater than 0")
        if self.warmup_seconds < 0:
            problems.append("--warmup-seconds must not be negative")
        if not 0 <= self.latency_jitter < 1:
            problems.append("--latency-jitter must be a fraction in [0, 1)")
        if self.hicache_host_tokens is not None and self.hicache_host_tokens < 0:
            problems.append("--hicache-host-tokens must not be negative")
        if self.dp_size != 1:
            problems.append("--dp-size: the simulator models one data-parallel rank")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def host_tokens(self) -> int:
        if not self.enable_hierarchical_cache:
            return 0
        if self.hicache_host_tokens is not None:
            return self.hicache_host_tokens
        if self.hicache_size > 0:
            return int(self.hicache_size * 1e9 // BYTES_PER_TOKEN)
        return int(self.max_total_tokens * self.hicache_ratio)

    @property
    def host_mamba_states(self) -> int:
        if self.hicache_mamba_states is not None:
            return self.hicache_mamba_states
        # The "too small" failure leaves room for a handful. Otherwise SGLang's MambaPoolHost: the device
        # Mamba pool times --hicache-ratio (the 0.5.23 fixture: 15 x 2 = 30 states).
        if self.hybrid_failure == "host_mamba_pool_small":
            return 4
        return max(1, int(self.max_mamba_cache_size * self.hicache_ratio))

    @property
    def max_req_input_len(self) -> int:
        return min(self.context_length, self.max_total_tokens) - 1

    @property
    def cache_type(self) -> str:
        # sglang-facts 3b: in current mem_cache/registry.py UnifiedRadixCache is the default for
        # every model, HiCache on or off; both fixtures label it so.
        return "UnifiedRadixCache"
