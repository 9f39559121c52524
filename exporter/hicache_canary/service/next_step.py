"""One line per verdict that says nothing about HiCache: why the probe could not tell, and what to do.

Pure data for the status page (and anyone else who shows a verdict to a person); the long form of
each line is in docs/runbooks/HiCacheCanaryInconclusive.md and HiCacheCanaryFailing.md.
"""

from __future__ import annotations

from hicache_canary.models import ErrorReason, ProbeRecord, Verdict

INCONCLUSIVE: dict[Verdict, str] = {
    Verdict.NOT_EVICTED: (
        "R was still on the device after the pressure, so this probe could not test the host tier. "
        "Next: nothing if the next probe is conclusive; if it repeats, raise max_pressure_tokens "
        "for this target (or leave it unset) and probe by hand with hicache-canary probe."
    ),
    Verdict.INCONCLUSIVE: (
        "R was evicted, but neither per-tier cached tokens nor the latency ratio could tell where the "
        "rehost came from. Next: raise context_tokens so a cold prefill takes seconds, and run SGLang "
        "with --enable-metrics so counters back the verdict."
    ),
    Verdict.SKIPPED_BUSY: (
        "Real users were queueing, so no probe ran (nothing was sent). Next: nothing, the canary "
        "retries within a quarter interval; if it never finds a quiet moment, raise busy_queue_threshold."
    ),
    Verdict.SKIPPED_BUDGET: (
        "This target's token_budget_per_hour is spent, so no probe ran. Next: raise "
        "token_budget_per_hour or lengthen the interval."
    ),
}

ERRORS: dict[ErrorReason, str] = {
    ErrorReason.CONNECT_FAILED: "check the URL and the network from the exporter's host; is SGLang running?",
    ErrorReason.CONNECTION_LOST: "SGLang (or a proxy) dropped the connection mid-request; read its log around the probe time for a crash or restart.",
    ErrorReason.TIMEOUT: "the server is overloaded or the prefill is slow on this GPU; raise the probe timeout or lower context_tokens.",
    ErrorReason.HTTP_5XX: "SGLang failed the request; read its log around the probe time.",
    ErrorReason.RATE_LIMITED: "a proxy in front of SGLang throttles the canary; probe SGLang directly.",
    ErrorReason.HTTP_4XX: "SGLang rejected the request shape; check `api: native|openai` for the target.",
    ErrorReason.UNAUTHORIZED: "SGLang runs with --api-key: set api_key_env or api_key_file for the target.",
    ErrorReason.BAD_RESPONSE: "SGLang answered something unexpected; /api/targets keeps the evidence.",
    ErrorReason.SERVER_RESTARTED: "SGLang restarted during the probe; nothing to do after a deploy, the next probe tells.",
    ErrorReason.TARGET_IS_ROUTER: "the URL is a router that may send the rehost to another worker; probe each worker directly.",
    ErrorReason.CONTEXT_TOO_LONG: "context_tokens is above the model's max_req_input_len; lower it.",
    ErrorReason.CANCELLED: "the exporter stopped the probe (shutdown or reload); nothing to do.",
    ErrorReason.INTERNAL: "an exporter bug; its log and /api/targets say where.",
}


def explain(rec: ProbeRecord) -> str | None:
    """Why this probe says nothing about HiCache and what to do next; None for a conclusive one."""
    if rec.verdict is None or rec.verdict.conclusive:
        return None
    if rec.verdict == Verdict.ERROR:
        step = ERRORS.get(rec.reason) if rec.reason else None
        what = f"The probe failed ({rec.reason.value})" if rec.reason else "The probe failed"
        return f"{what}, so it says nothing about HiCache. Next: {step or 'read the exporter log and /api/targets.'}"
    return INCONCLUSIVE[rec.verdict]
