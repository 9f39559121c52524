"""Render `/metrics` exactly as SGLang 0.5.23 or 0.5.17 emits it (names, HELP, TYPE, label sets).

Family list, HELP text, label keys, pre-seeded children and histogram buckets come from templates
generated from the real fixtures (templates/build_templates.py); this module only supplies values.
Label rules, as in the fixtures:
- scheduler series: `engine_type, model_name, moe_ep_rank, pp_rank, tp_rank`, from rank 0 only
  (families SGLang pre-seeds on every rank repeat with zeros on the other ranks);
- radix-cache series (0.5.23): `cache_type, dp_rank, pp_rank, tp_rank`, the same count on every
  TP rank; 0.5.17: `cache_type` only;
- tokenizer series: `engine_type, model_name`.
Labelled children appear on first increment: radix-cache families (evicted, backup, load-back,
dropped), `cached_tokens_total{cache_source}` children and tokenizer histograms are absent until used.
Values are simulated seconds (wall time / time_scale) wherever SGLang reports seconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from .config import BYTES_PER_TOKEN, SimConfig
from .engine import Engine, Hist
from .templates import metrics_0_5_17, metrics_0_5_23

TEMPLATES = {"0.5.23": metrics_0_5_23.FAMILIES, "0.5.17": metrics_0_5_17.FAMILIES}
ENGINE_TYPE = "unified"
# Not in any fixture (nothing was dropped there); name and labels from sglang-facts 1a, HELP ours.
DROPPED_FAMILY = {
    "name": "sglang:hicache_dropped_tokens_total", "type": "counter", "scope": "radix_ranked",
    "help": "The number of device KV tokens destroyed without a host backup, by reason and pool "
            "(e.g. reason=host_pressure when write_back cannot free host space).",
    "base_labels": ["cache_type"], "rank_labels": ["dp_rank", "pp_rank", "tp_rank"], "children": [], "defaults": [],
    "buckets": [],
}
RADIX_PREFIXES = ("sglang:evicted_", "sglang:eviction_", "sglang:load_back_", "sglang:hicache_")
HICACHE_ONLY = ("sglang:hicache_",)
# Plausible transfer costs for the radix-cache duration histograms (not a model: SGLang times real copies).
EVICTION_PASS_S = 0.0018
COPY_BYTES_PER_S = 10e9


def bucket_bounds(profile: str) -> dict[str, list[float]]:
    """Histogram bounds per family for the engine's observations."""
    return {f["name"]: [float(b) for b in f["buckets"]] for f in TEMPLATES[profile] if f["type"] == "histogram"}


@dataclass
class HttpStats:
    """Per-endpoint HTTP counts (0.5.17 exports them as sglang:http_*)."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    responses: dict[tuple[str, str, str], int] = field(default_factory=dict)
    active: dict[tuple[str, str], int] = field(default_factory=dict)


def _fixed_hist(bounds: list[float], count: int, each: float) -> Hist:
    h = Hist(bounds)
    if count:
        h.counts[sum(1 for b in bounds if b < each)] = count
        h.count, h.sum = count, count * each
    return h


def _values(cfg: SimConfig, engine: Engine, http: HttpStats) -> tuple[dict, dict, set]:
    """(counter/gauge children, histogram children, absent families) for this scrape."""
    c, s, st = engine.cache, engine.stats, engine.cache.stats
    hicache, hybrid = cfg.enable_hierarchical_cache, cfg.hybrid_model
    v: dict[str, list[tuple[dict, float]]] = {}
    h: dict[str, list[tuple[dict, Hist]]] = {}
    absent: set[str] = set()

    def one(name: str, value: float) -> None:
        v[name] = [({}, value)]

    def by(name: str, label: str, d: dict) -> None:
        if d:
            v[name] = [({label: k}, val) for k, val in d.items()]
        else:
            absent.add(name)

    # tokenizer
    by("sglang:prompt_tokens_total", "is_streaming", s.prompt_tokens)
    by("sglang:generation_tokens_total", "is_streaming", s.generation_tokens)
    by("sglang:num_requests_total", "is_streaming", s.num_requests)
    by("sglang:cached_tokens_total", "cache_source", s.cached_tokens)
    if cfg.speculative_algorithm is None:
        absent.add("sglang:spec_verify_calls_total")
    else:
        one("sglang:spec_verify_calls_total", 0)
    streaming = next(iter(s.num_requests), "false")
    for name, hist in s.hists.items():
        if hist.count == 0 and name in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds",
                                        "sglang:request_time_per_output_token_seconds",
                                        "sglang:inter_token_latency_seconds", "sglang:prompt_tokens_histogram",
                                        "sglang:uncached_prompt_tokens_histogram",
                                        "sglang:generation_tokens_histogram"):
            absent.add(name)
            continue
        if hist.count == 0:
            continue  # the template's pre-seeded zero children render instead
        labels = {"is_streaming": streaming} if name in (
            "sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds",
            "sglang:request_time_per_output_token_seconds") else {}
        h[name] = [(labels, hist)]

    # scheduler
    v["sglang:prefill_effective_tokens_total"] = [({"mode": k}, n) for k, n in s.prefill_effective.items()]
    v["sglang:realtime_tokens_total"] = [({"mode": k}, n) for k, n in s.realtime.items()]
    v["sglang:forward_execution_seconds_total"] = [({"category": k}, n) for k, n in s.forward_s.items()]
    n_req = sum(s.num_requests.values())
    v["sglang:cuda_graph_passes_total"] = [({"mode": "prefill_none"}, n_req),
                                           ({"mode": "decode_none"}, sum(s.generation_tokens.values()))]
    locked, inflight = c.locked_tokens(), c.inflight
    evictable = c.evictable_tokens()
    used = locked + inflight
    available = cfg.max_total_tokens - used - evictable
    m_locked, m_evictable = c.mamba_device_states() if hybrid else (0, 0)
    m_used = m_locked + (engine.running if hybrid else 0)
    m_avail = max(cfg.max_mamba_cache_size - m_used - m_evictable, 0) if hybrid else 0
    full_usage = used / cfg.max_total_tokens
    mamba_usage = (m_used / cfg.max_mamba_cache_size) if hybrid else 0.0
    for name, value in {
        "num_running_reqs": engine.running, "num_queue_reqs": engine.queued,
        "max_total_num_tokens": cfg.max_total_tokens, "page_size": cfg.page_size,
        "num_pages": cfg.max_total_tokens // cfg.page_size, "context_len": cfg.context_length,
        "cache_hit_rate": s.cache_hit_rate, "num_used_tokens": used, "kv_used_tokens": used,
        "kv_available_tokens": available, "kv_evictable_tokens": evictable,
        "full_token_usage": full_usage, "token_usage": max(full_usage, mamba_usage), "mamba_usage": mamba_usage,
        "mamba_used_tokens": m_used, "mamba_evictable_tokens": m_evictable, "mamba_available_tokens": m_avail,
        "decode_sum_seq_lens": 0, "gen_throughput": 0.0, "num_retracted_reqs": 0, "num_paused_reqs": 0,
        "num_unique_running_routing_keys": 0, "routing_keys_active": 0,
    }.items():
        one("sglang:" + name, value)
    if cfg.speculative_algorithm is None:
        for name in ("spec_accept_length", "spec_accept_rate", "spec_num_steps", "spec_num_draft_tokens"):
            one("sglang:" + name, 0.0)
    if hicache:
        one("sglang:hicache_host_used_tokens", c.host_used)
        one("sglang:hicache_host_total_tokens", cfg.host_tokens)
    if hicache and hybrid:
        one("sglang:hicache_host_mamba_used_states", c.host_mamba_used)
        one("sglang:hicache_host_mamba_total_states", cfg.host_mamba_states)
    else:
        absent |= {"sglang:hicache_host_mamba_used_states", "sglang:hicache_host_mamba_total_states"}

    # radix cache: absent until first use
    ranked = cfg.metrics_profile == "0.5.23"
    if st.evicted_tokens:
        one("sglang:evicted_tokens_total", st.evicted_tokens)
        h["sglang:eviction_duration_seconds"] = [({}, _fixed_hist(_bounds(cfg, "sglang:eviction_duration_seconds"),
                                                                  st.eviction_passes, EVICTION_PASS_S))]
    else:
        absent |= {"sglang:evicted_tokens_total", "sglang:eviction_duration_seconds"}
    if hicache and st.backup_tokens:
        v["sglang:hicache_backup_tokens_total"] = [({"pool": p}, n) for p, n in st.backup_tokens.items()]
        kv_bytes = st.backup_tokens.get("kv", 0) * BYTES_PER_TOKEN
        one("sglang:hicache_backup_bytes_total", kv_bytes)
        h["sglang:hicache_backup_duration_seconds"] = [({}, _fixed_hist(
            _bounds(cfg, "sglang:hicache_backup_duration_seconds"), st.backup_ops,
            kv_bytes / max(st.backup_ops, 1) / COPY_BYTES_PER_S))]
    else:
        absent |= {"sglang:hicache_backup_tokens_total", "sglang:hicache_backup_bytes_total",
                   "sglang:hicache_backup_duration_seconds"}
    if hicache and st.load_back_tokens:
        if ranked:
            v["sglang:load_back_tokens_total"] = [({"pool": p}, n) for p, n in st.load_back_tokens.items()]
        else:
            one("sglang:load_back_tokens_total", st.load_back_tokens.get("kv", 0))
        lb_bytes = st.load_back_tokens.get("kv", 0) * BYTES_PER_TOKEN
        one("sglang:load_back_bytes_total", lb_bytes)
        h["sglang:load_back_duration_seconds"] = [({}, _fixed_hist(
            _bounds(cfg, "sglang:load_back_duration_seconds"), st.load_back_ops,
            lb_bytes / max(st.load_back_ops, 1) / COPY_BYTES_PER_S))]
    else:
        absent |= {"sglang:load_back_tokens_total", "sglang:load_back_bytes_total", "sglang:load_back_duration_seconds"}
    if hicache and st.dropped_tokens:
        v["sglang:hicache_dropped_tokens_total"] = [({"pool": "kv", "reason": r}, n) for r, n in st.dropped_tokens.items()]
    else:
        absent.add("sglang:hicache_dropped_tokens_total")

    # process-level (0.5.17)
    v["sglang:http_requests_total"] = [({"endpoint": e, "method": m}, n) for (e, m), n in http.requests.items()]
    v["sglang:http_requests_active"] = [({"endpoint": e, "method": m}, n) for (e, m), n in http.active.items()]
    v["sglang:http_responses_total"] = [({"endpoint": e, "method": m, "status_code": sc}, n)
                                        for (e, m, sc), n in http.responses.items()]
    v["sglang:process_cpu_seconds_total"] = [({"component": "tokenizer"}, time.process_time()),
                                             ({"component": "detokenizer"}, 0.0)]
    return v, h, absent


def _bounds(cfg: SimConfig, name: str) -> list[float]:
    return bucket_bounds(cfg.metrics_profile).get(name, [])


def _fmt_labels(labels: dict) -> str:
    inner = ",".join(
        '{}="{}"'.format(k, str(labels[k]).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))
        for k in sorted(labels))
    return "{" + inner + "}" if inner else ""


def _rank_sets(cfg: SimConfig, fam: dict) -> list[tuple[dict, bool]]:
    """(base+rank labels, is rank 0) for every rank a family is emitted on."""
    scope = fam["scope"]
    if scope == "tokenizer":
        return [({"engine_type": ENGINE_TYPE, "model_name": cfg.served_model_name}, True)]
    if scope == "global":
        return [({}, True)]
    if scope == "radix":
        return [({"cache_type": cfg.cache_type}, True)]
    ranks = range(cfg.tp_size - 1, -1, -1) if scope in ("radix_ranked", "scheduler_all_ranks") else [0]
    out = []
    for r in ranks:
        if scope == "radix_ranked":
            labels = {"cache_type": cfg.cache_type, "dp_rank": "0", "pp_rank": "0", "tp_rank": str(r)}
        else:
            labels = {"engine_type": ENGINE_TYPE, "model_name": cfg.served_model_name, "moe_ep_rank": "0",
                      "pp_rank": "0", "tp_rank": str(r)}
            if "pid" in fam["rank_labels"]:
                labels["pid"] = str(os.getpid())
        out.append((labels, r == 0))
    return out


def _families(cfg: SimConfig) -> list[dict]:
    fams = list(TEMPLATES[cfg.metrics_profile])
    if cfg.metrics_profile == "0.5.23":
        at = next(i for i, f in enumerate(fams) if f["name"] == "sglang:hicache_backup_bytes_total") + 1
        fams.insert(at, DROPPED_FAMILY)
    return fams


def render(cfg: SimConfig, engine: Engine, http: HttpStats) -> str:
    values, hists, absent = _values(cfg, engine, http)
    if not cfg.enable_hierarchical_cache:
        absent |= {f["name"] for f in _families(cfg) if f["name"].startswith(HICACHE_ONLY)}
    if cfg.faults.metrics_missing:
        absent |= {f["name"] for f in _families(cfg) if f["name"].startswith(RADIX_PREFIXES)}
    per_rank_seeded = cfg.metrics_profile == "0.5.23"
    lines: list[str] = []
    for fam in _families(cfg):
        name = fam["name"]
        if name in absent:
            continue
        out: list[str] = []
        for base, rank0 in _rank_sets(cfg, fam):
            if not rank0 and fam["scope"] == "scheduler_all_ranks" and not per_rank_seeded:
                continue
            if fam["type"] == "histogram":
                children = hists.get(name) or [(ch, Hist([float(b) for b in fam["buckets"]])) for ch in fam["children"]]
                for extra, hist in children:
                    if not rank0 and fam["scope"] == "scheduler_all_ranks":
                        hist = Hist(hist.bounds)
                    out.extend(_hist_lines(name, {**base, **extra}, hist))
                continue
            if name in values:
                children = values[name]
            else:
                # Counters start at zero; constant gauges (memory, startup) keep the fixture's values.
                children = [(ch, 0.0 if fam["type"] == "counter" else d) for ch, d in zip(fam["children"], fam["defaults"])]
            for extra, value in children:
                if not rank0 and fam["scope"] == "scheduler_all_ranks":
                    value = 0.0
                out.append(f"{name}{_fmt_labels({**base, **extra})} {floatToGoString(value)}")
        if not out:
            continue
        lines.append(f"# HELP {name} {fam['help']}")
        lines.append(f"# TYPE {name} {fam['type']}")
        lines.extend(out)
    return "\n".join(lines) + "\n"


def _hist_lines(name: str, labels: dict, hist: Hist) -> list[str]:
    out = [f"{name}_sum{_fmt_labels(labels)} {floatToGoString(hist.sum)}"]
    acc = 0
    for bound, n in zip([*hist.bounds, float("inf")], hist.counts):
        acc += n
        out.append(f"{name}_bucket{_fmt_labels({**labels, 'le': floatToGoString(bound)})} {floatToGoString(acc)}")
    out.append(f"{name}_count{_fmt_labels(labels)} {floatToGoString(hist.count)}")
    return out
