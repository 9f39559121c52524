"""The per-target knobs: every setting a target (or `defaults`) may give, with its one built-in default.

This table is the only place a knob is declared. From it come the config's `TargetFields` (its YAML
keys and their validation, config_target.py), the built-in values, `models.ProbeSettings` (the knobs
a probe reads) and the names /api/targets shows. Adding a knob is adding one row here.

No pydantic here: models.py builds ProbeSettings from this table and must stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Knob:
    key: str  # YAML key under a target or `defaults`
    kind: str  # how it is validated: a key of config_types.KINDS
    type: Any  # Python type of the resolved value
    default: Any  # built-in value; None: unset (the probe decides, e.g. from the server's pool)
    attr: str  # attribute on ProbeSettings (probe=True) or on config.Target (probe=False)
    probe: bool = True  # False: read by the scheduler, not by the probe
    shown: str | None = None  # key in Target.summary() (/api/targets, status page); None: not shown
    doc: str = ""


KNOBS: tuple[Knob, ...] = (
    Knob("interval", "duration", float, 900.0, "interval_s", probe=False, shown="interval_seconds"),
    Knob("confirm_after", "duration_or_zero", float, 60.0, "confirm_after_s", probe=False, shown="confirm_after_seconds",
         doc="early re-probe after a first `silent` verdict (0: wait the interval); capped at `interval`"),
    Knob("watch_interval", "duration_or_zero", float, 30.0, "watch_interval_s", probe=False, shown="watch_interval_seconds",
         doc="GET /metrics this often between probes to notice a restart (0: off); see watch.py"),
    Knob("restart_probe_delay", "duration_or_zero", float, 60.0, "restart_probe_delay_s", probe=False,
         shown="restart_probe_delay_seconds",
         doc="after a restart, probe this much later (warm-up), never later than the next scheduled probe"),
    # Longer than SGLang's usual chunked_prefill_size (4096-8192) so the chunked path, where
    # write_through loses backups, is exercised; a fraction of the report's 40K so a probe costs
    # seconds, not a quarter of a minute, of prefill. Clamped to the server's max_req_input_len.
    Knob("context_tokens", "positive_int", int, 16384, "context_tokens", shown="context_tokens"),
    Knob("max_pressure_tokens", "positive_int", int | None, None, "max_pressure_tokens", shown="max_pressure_tokens",
         doc="cap on synthetic filler per probe (None: 4x device pool)"),
    Knob("pressure_chunk_tokens", "positive_int", int | None, None, "pressure_chunk_tokens",
         doc="filler per request; None: pressure.chunk_tokens (>= R)"),
    Knob("busy_queue_threshold", "non_negative_int", int, 2, "busy_queue_threshold", shown="busy_queue_threshold",
         doc="skip (skipped_busy) when sglang:num_queue_reqs is above this"),
    Knob("busy_running_threshold", "non_negative_int", int | None, None, "busy_running_threshold",
         shown="busy_running_threshold", doc="and/or when num_running_reqs is above this"),
    Knob("token_budget_per_hour", "positive_int", int, 2_000_000, "token_budget_per_hour", probe=False,
         shown="token_budget_per_hour"),
    Knob("api", "api", str, "auto", "api", shown="api", doc="auto | native | openai"),
    Knob("request_timeout", "duration", float, 300.0, "timeout_s",
         doc="per request; a cold 40K prefill takes ~15 s on the report's GPU"),
    # A third of the default 15-minute interval: a busy node needs minutes to turn a 355K-token pool over.
    Knob("passive_wait", "duration_or_zero", float, 300.0, "passive_wait_s",
         doc="how long the server's own traffic may take to evict R before filler covers the rest"),
    Knob("poll_interval", "duration", float, 1.0, "poll_interval_s", doc="counter polling while waiting for eviction"),
    Knob("min_cold_latency", "duration_or_zero", float, 1.0, "min_cold_latency_s",
         doc="below this a latency ratio alone never decides"),
    Knob("host_hit_threshold", "ratio", float, 0.5, "host_hit_threshold",
         doc="rehost host-cached share at or above which R counts as reused"),
    Knob("dp_rank", "non_negative_int", int | None, None, "dp_rank", doc="pin to this DP rank (None: rotate when dp_size > 1)"),
)

PROBE_KNOBS = tuple(k for k in KNOBS if k.probe)
SCHEDULE_KNOBS = tuple(k for k in KNOBS if not k.probe)
# Built-in values for anything neither the target nor `defaults` sets.
BUILTIN: dict[str, Any] = {k.key: k.default for k in KNOBS}
