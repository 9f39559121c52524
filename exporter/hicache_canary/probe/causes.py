"""Pure: why a `silent` probe was silent, and whether the probe's own filler explains the miss.

Guard against the probe's own filler (hybrid models), tried when no specific cause (chunked R, Mamba
state never backed up) explains the miss: every filler request is a context, and under write_through
each backs up its own host Mamba state (under write_back, each context it evicts does). When as many
states as the host Mamba pool holds (`hicache_host_mamba_total_states`) were backed up after R (or,
without that counter, the probe sent that many filler requests), a host miss is not evidence against
the server -> `inconclusive`, naming what to change
(a larger `context_tokens` / `pressure_chunk_tokens`: fewer, larger contexts) - unless the host KV pool
holds at least twice as many contexts of R's length as the Mamba pool has states, and the device pool
at least as many: then any workload of such contexts loses states long before KV, a real
`host_pool_pressure` read from the gauges alone.

Suspected cause of `silent` (counter deltas over the probe; first match wins, specific evidence first):
- `chunked_prefill_not_backed_up`: write_through(_selective), R longer than `chunked_prefill_size`,
  and the KV backups between R's cold send and the start of pressure are below half of R.
- `mamba_state_not_backed_up`: hybrid model, KV backed up (>= half of R) but the Mamba backups are 0
  or below a quarter of the contexts we inserted (R plus each filler request).
- `host_pool_pressure`: `hicache_dropped_tokens_total{reason="host_pressure"}` grew, or the host
  Mamba pool was full (states) when R was re-sent, or part of R came back from host while the host
  KV pool had less room left than R (what 0.5.17 exports: live, 6,144 of 14,336 from host with
  46,336 of 48,001 used). A full host KV pool alone is not: under write_through it fills up as a
  matter of course (the report's reached 592,658 of 709,577, with 116,919 free, above R's 40,960).
  Also when the host pool is smaller than the device pool plus R (`--hicache-ratio` near 1): the
  turnover that evicts R from the device backs up more than the host can hold beside R.
- `load_back_skipped`: KV and Mamba backed up, no pressure, yet the rehost loaded nothing back.
- `unknown`: none of the above, or the counters needed are missing (0.5.17 has no backup counter).
"""

from __future__ import annotations

from hicache_canary.probe.evidence import Decision, cacheable_tokens, delta, known_counters, labelled_delta, r_prompt_tokens, total
from hicache_canary.models import Cause, CounterSnapshot, Phase, ProbeRecord, ServerFacts, Verdict

# R's KV never reached host, or its state never did: the miss is explained whatever filled the Mamba pool.
SPECIFIC_CAUSES = (Cause.CHUNKED_PREFILL_NOT_BACKED_UP, Cause.MAMBA_STATE_NOT_BACKED_UP)
MAMBA_POOL_OUTGROWN = 2  # host KV contexts of R's length per host Mamba state that make the pool the bottleneck
MAMBA_BACKUP_SHARE = 0.25
KV_BACKUP_SHARE = 0.5


def suspect_cause(record: ProbeRecord, rehost_host: float | None = None) -> tuple[Cause, str]:
    """Why a silent probe was silent, from counter deltas; returns the cause and a short clause.

    `rehost_host`: R's tokens the rehost took from host, when tier evidence says.
    """
    facts = record.server or ServerFacts()
    cold, pressure, rehost = (record.step(p) for p in (Phase.COLD, Phase.PRESSURE, Phase.REHOST))
    r = cacheable_tokens(record)
    start = cold.before if cold else None
    planted = (pressure.before if pressure and pressure.before else None) or (cold.after if cold else None)
    end = (rehost.before if rehost else None) or (pressure.after if pressure else None)
    if start is None or end is None:
        return Cause.UNKNOWN, "SGLang counters were not available"
    known = known_counters(record)
    kv_cold = labelled_delta(start, planted, "backup_tokens", "kv", known)
    kv_all = labelled_delta(start, end, "backup_tokens", "kv", known)
    mamba_all = labelled_delta(start, end, "backup_tokens", "mamba", known)
    length = r_prompt_tokens(record)
    if (
        facts.write_policy in ("write_through", "write_through_selective")
        and facts.chunked_prefill_size
        and length > facts.chunked_prefill_size
        and kv_cold is not None
        and kv_cold < KV_BACKUP_SHARE * r
    ):
        return Cause.CHUNKED_PREFILL_NOT_BACKED_UP, (
            f"R ({length} tokens) is longer than chunked_prefill_size {facts.chunked_prefill_size} "
            f"and only {kv_cold:.0f} KV tokens were backed up after its cold prefill"
        )
    contexts = 1 + (record.pressure.chunks or 0)
    if (
        facts.hybrid_model
        and kv_all is not None
        and mamba_all is not None
        and kv_all >= KV_BACKUP_SHARE * r
        and mamba_all < max(1.0, MAMBA_BACKUP_SHARE * contexts)
    ):
        return Cause.MAMBA_STATE_NOT_BACKED_UP, (
            f"{kv_all:.0f} KV tokens but only {mamba_all:.0f} Mamba states were backed up "
            f"for {contexts} inserted contexts"
        )
    dropped = _host_pressure_drops(start, end)
    mamba_full = (
        end.host_mamba_used_states is not None
        and end.host_mamba_total_states
        and end.host_mamba_used_states >= end.host_mamba_total_states
    )
    if (dropped or 0) > 0 or mamba_full:
        what = (
            f"{dropped:.0f} tokens were dropped without host backup (reason host_pressure)" if (dropped or 0) > 0
            else f"the host Mamba pool was full ({end.host_mamba_used_states:.0f}/{end.host_mamba_total_states:.0f} states)"
        )
        return Cause.HOST_POOL_PRESSURE, what
    host_free = None if end.host_total_tokens is None or end.host_used_tokens is None else end.host_total_tokens - end.host_used_tokens
    if rehost_host and host_free is not None and host_free < r:
        # Part of R came back, the rest was gone from a host pool with no room left for R: the host
        # tier evicted it. What 0.5.17 exports (no drop or backup counters) is enough to say so.
        return Cause.HOST_POOL_PRESSURE, (
            f"the host pool was full when R was re-sent ({end.host_used_tokens:.0f} of {end.host_total_tokens:.0f} tokens, "
            f"{host_free:.0f} free, less than R's {r}), and only part of R came back from host"
        )
    device = end.max_total_num_tokens or facts.max_total_num_tokens
    if end.host_total_tokens and device and end.host_total_tokens < device + r:
        # Evicting R from the device takes about a device pool of newer contexts, and each of them is
        # backed up (write_through at insert, write_back at eviction): a host pool smaller than that
        # plus R has pushed R out of host by the time R comes back, for any workload, not just ours.
        return Cause.HOST_POOL_PRESSURE, (
            f"the host pool ({end.host_total_tokens:.0f} tokens) holds less than the device pool ({device:.0f}) plus R ({r}): "
            f"whatever evicts R from the device also pushes it out of host (raise --hicache-ratio or --hicache-size)"
        )
    if kv_all is None or (mamba_all is None and facts.hybrid_model):
        return Cause.UNKNOWN, "this server exports no hicache_backup_tokens_total to tell why"
    load_back = labelled_delta(rehost.before, rehost.after, "load_back_tokens", "kv", known | {"load_back_tokens"}) if rehost else None
    if load_back is None and rehost is not None and rehost.before and rehost.after:
        load_back = delta(total(rehost.before.load_back_tokens) or 0.0, total(rehost.after.load_back_tokens) or 0.0)
    if kv_all >= KV_BACKUP_SHARE * r and (load_back or 0) == 0:
        return Cause.LOAD_BACK_SKIPPED, f"{kv_all:.0f} KV tokens were backed up, nothing was dropped, yet nothing was loaded back"
    return Cause.UNKNOWN, "the counters show no known failure pattern"


def _host_pressure_drops(start: CounterSnapshot, end: CounterSnapshot) -> float | None:
    """Growth of hicache_dropped_tokens_total{reason="host_pressure"} (all reasons if unlabelled)."""
    def value(snap: CounterSnapshot) -> float:
        d = snap.dropped_tokens or {}
        return d.get("host_pressure", 0.0) if any(k for k in d) else sum(d.values())
    if start.dropped_tokens is None and end.dropped_tokens is None:
        return None
    return delta(value(start), value(end))


def _any_snapshot_value(record: ProbeRecord, attr: str) -> float | None:
    for step in reversed(record.steps):
        for snap in (step.after, step.before):
            if snap is not None and getattr(snap, attr):
                return getattr(snap, attr)
    return None


def own_mamba_pressure(record: ProbeRecord) -> Decision | None:
    """The guard (module docstring): did the probe's own filler push R's state out of the host Mamba pool?

    None when it cannot have; else the decision to give instead of a plain `silent`.
    """
    facts = record.server or ServerFacts()
    states = _any_snapshot_value(record, "host_mamba_total_states")
    contexts = record.pressure.chunks or 0
    if not facts.hybrid_model or not states:
        return None
    pressure, rehost = record.step(Phase.PRESSURE), record.step(Phase.REHOST)
    planted = pressure.before if pressure else None
    end = (rehost.before if rehost else None) or (pressure.after if pressure else None)
    # States backed up after R, whoever's: under write_back the filler's evictions of the server's own
    # small contexts back up one state each, too. Without the counter, our filler requests.
    backed = labelled_delta(planted, end, "backup_tokens", "mamba", known_counters(record))
    if (backed if backed is not None else contexts) < states:
        return None  # fewer states reached host than it holds: none of R's can have been pushed out
    length = r_prompt_tokens(record) or 1
    host_total = _any_snapshot_value(record, "host_total_tokens")
    held = host_total / length if host_total else 0.0
    device = _any_snapshot_value(record, "max_total_num_tokens") or facts.max_total_num_tokens
    # ... and R-sized traffic that pushes R off the device backs up at least `states` states on the way
    # (write_through backs each context up at insert), so the loss is the server's, not the probe's.
    device_held = device / length if device else float("inf")
    if held >= MAMBA_POOL_OUTGROWN * states and device_held >= states:
        return Decision(
            Verdict.SILENT,
            cause=Cause.HOST_POOL_PRESSURE,
            evidence=(
                f"the host KV pool holds {held:.0f} contexts of R's {length} tokens but the host Mamba pool only "
                f"{states:.0f} states: every context backed up after R pushes a state out, so host KV of R-sized "
                f"contexts is dead memory (size the host Mamba pool up)"
            ),
        )
    return Decision(
        Verdict.INCONCLUSIVE,
        evidence=(
            f"{backed if backed is not None else contexts:.0f} Mamba states were backed up after R (the probe sent "
            f"{contexts} filler requests, the rest is the server's traffic), as many as the host Mamba pool holds "
            f"({states:.0f}), so the probe's pressure may have pushed R's state out of host; raise context_tokens or "
            f"pressure_chunk_tokens so fewer, larger requests evict R"
        ),
    )
