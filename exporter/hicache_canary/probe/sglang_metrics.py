"""Parse SGLang's Prometheus exposition into a CounterSnapshot (pure: no IO, no clock).

SGLang emits the same number several times, and which copy to read depends on who wrote it:

* Radix-cache counters (`hicache_backup_tokens_total{pool}`, `load_back_tokens_total{pool}`,
  `evicted_tokens_total`, `hicache_dropped_tokens_total{reason,pool}`) are written by every
  TP (and PP) rank of a DP rank, each repeating the same count of its shared radix tree. We read
  the lowest (tp_rank, pp_rank) of each DP rank and sum over DP ranks: each DP rank has its own
  tree, so those counts are disjoint. Summing across TP would double a TP=2 server's backups.
* Scheduler series (`hicache_host_used_tokens`, `kv_available_tokens`, `num_queue_reqs`,
  `prefill_effective_tokens_total{mode}`, ...) are logged by the stats rank (tp_rank 0; other
  ranks may emit zeros). Same rule: lowest rank per DP rank, summed over DP ranks. For pool sizes
  that sum is the capacity of all DP ranks together; queue and running counts add up naturally.
* Tokenizer counters (`cached_tokens_total{cache_source}`, `prompt_tokens_total{is_streaming}`)
  carry no rank label: all children with the same key are summed.

Dict fields are keyed by their distinguishing label; a sample without that label (SGLang 0.5.17's
`load_back_tokens_total{cache_type}`, or `cached_tokens_total` before `cache_source` existed) is
keyed "". A family that is absent gives None, never 0.

Names: SGLang writes `sglang:<name>`; sgl-router's aggregated metrics rewrite that to
`sglang_<name>`. Both are accepted (colon wins when a name appears in both forms) and `families`
then holds ROUTER_PREFIX_MARKER so the canary can say "this looks like a router".

Garbled input never raises. prometheus_client's parser stops at the first bad line, so on failure
the text is re-parsed family block by family block, then line by line inside a bad block, keeping
every good sample and recording at most MAX_ERRORS short descriptions in `parse_errors`.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from hicache_canary.models import CounterSnapshot

COLON_PREFIX = "sglang:"
UNDERSCORE_PREFIX = "sglang_"
# Put in CounterSnapshot.families when only underscore names were seen (sgl-router's renaming).
ROUTER_PREFIX_MARKER = "<sglang_ underscore prefix: router?>"
MAX_ERRORS = 10
MAX_ERROR_LEN = 160

_NAME_RE = re.compile(r"^\s*([A-Za-z_:][A-Za-z0-9_:]*)")
_HEADER_RE = re.compile(r"^#\s+(HELP|TYPE)\s+([A-Za-z_:][A-Za-z0-9_:]*)")


@dataclass(frozen=True)
class _Sample:
    name: str  # without the sglang prefix
    labels: dict[str, str]
    value: float


def looks_like_router(snapshot: CounterSnapshot) -> bool:
    """True when the exposition used sgl-router's `sglang_` names instead of SGLang's own."""
    return ROUTER_PREFIX_MARKER in snapshot.families


# The families a snapshot reads (names without the sglang prefix). SGLang's /metrics is ~90 KB,
# mostly histogram buckets we never read; blanking those lines before parsing keeps a parse cheap
# enough to run around every probe step without stalling the exporter.
READ_FAMILIES = frozenset(
    {
        "hicache_host_used_tokens", "hicache_host_total_tokens",
        "hicache_host_mamba_used_states", "hicache_host_mamba_total_states",
        "hicache_backup_tokens_total", "load_back_tokens_total", "evicted_tokens_total",
        "hicache_dropped_tokens_total", "prefill_effective_tokens_total", "cached_tokens_total",
        "prompt_tokens_total", "num_running_reqs", "num_queue_reqs", "kv_available_tokens",
        "kv_evictable_tokens", "num_used_tokens", "max_total_num_tokens",
    }
)
_WANTED = frozenset(
    {COLON_PREFIX + n for n in READ_FAMILIES} | {UNDERSCORE_PREFIX + n for n in READ_FAMILIES}
    | {"process_start_time_seconds"}
)
# A well-formed sample line: name, optional {labels}, value, optional timestamp.
_SAMPLE_RE = re.compile(r'^[A-Za-z_:][A-Za-z0-9_:]*(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?[ \t]+\S+([ \t]+-?\d+)?[ \t]*$')


def parse_snapshot(text: str, taken_at: float = 0.0) -> CounterSnapshot:
    """Aggregate one `/metrics` body the way SGLang emits each family (see module docstring)."""
    typed, kept = _only_read_families(text)
    families, samples, errors = _parse_tolerant(kept)
    families |= typed
    colon = [s for s in samples if s[0].startswith(COLON_PREFIX)]
    under = [s for s in samples if s[0].startswith(UNDERSCORE_PREFIX)]
    by_name: dict[str, list[_Sample]] = defaultdict(list)
    colon_names = {n[len(COLON_PREFIX):] for n, _, _ in colon}
    for name, labels, value in colon:
        by_name[name[len(COLON_PREFIX):]].append(_Sample(name[len(COLON_PREFIX):], labels, value))
    router = False
    for name, labels, value in under:
        short = name[len(UNDERSCORE_PREFIX):]
        if short not in colon_names:
            router = True
            by_name[short].append(_Sample(short, labels, value))
    for name, labels, value in samples:
        if name == "process_start_time_seconds":
            by_name[name].append(_Sample(name, labels, value))

    fam_names = set()
    for fam in families:
        for prefix in (COLON_PREFIX, UNDERSCORE_PREFIX):
            if fam.startswith(prefix):
                fam = fam[len(prefix):]
                break
        fam_names.add(fam)
    if router and not colon:
        fam_names.add(ROUTER_PREFIX_MARKER)

    def sched(name: str) -> float | None:
        return _total(_one_rank_per_dp(by_name.get(name)))

    def sched_by(name: str, key: str) -> dict[str, float] | None:
        return _keyed(_one_rank_per_dp(by_name.get(name)), key)

    start = by_name.get("process_start_time_seconds")
    return CounterSnapshot(
        taken_at=taken_at,
        host_used_tokens=sched("hicache_host_used_tokens"),
        host_total_tokens=sched("hicache_host_total_tokens"),
        host_mamba_used_states=sched("hicache_host_mamba_used_states"),
        host_mamba_total_states=sched("hicache_host_mamba_total_states"),
        backup_tokens=sched_by("hicache_backup_tokens_total", "pool"),
        load_back_tokens=sched_by("load_back_tokens_total", "pool"),
        evicted_tokens=sched("evicted_tokens_total"),
        dropped_tokens=sched_by("hicache_dropped_tokens_total", "reason"),
        prefill_effective_tokens=sched_by("prefill_effective_tokens_total", "mode"),
        cached_tokens=_keyed(by_name.get("cached_tokens_total"), "cache_source"),
        prompt_tokens=_total(by_name.get("prompt_tokens_total")),
        num_running_reqs=sched("num_running_reqs"),
        num_queue_reqs=sched("num_queue_reqs"),
        kv_available_tokens=sched("kv_available_tokens"),
        kv_evictable_tokens=sched("kv_evictable_tokens"),
        num_used_tokens=sched("num_used_tokens"),
        max_total_num_tokens=sched("max_total_num_tokens"),
        process_start_time=max(s.value for s in start) if start else None,
        families=frozenset(fam_names),
        parse_errors=tuple(errors),
    )


def _rank(labels: dict[str, str], name: str) -> tuple[float, str]:
    # Numeric order when the label is a number ("10" after "9"), string order otherwise.
    raw = labels.get(name, "0")
    try:
        return (float(int(raw)), "")
    except ValueError:
        return (math.inf, raw)


def _one_rank_per_dp(samples: list[_Sample] | None) -> list[_Sample] | None:
    """Keep, for each dp_rank, only the samples of its lowest (tp_rank, pp_rank, moe_ep_rank)."""
    if not samples:
        return None
    best: dict[str, tuple] = {}
    for s in samples:
        dp = s.labels.get("dp_rank", "")
        r = (_rank(s.labels, "tp_rank"), _rank(s.labels, "pp_rank"), _rank(s.labels, "moe_ep_rank"))
        if dp not in best or r < best[dp]:
            best[dp] = r
    return [
        s
        for s in samples
        if (_rank(s.labels, "tp_rank"), _rank(s.labels, "pp_rank"), _rank(s.labels, "moe_ep_rank"))
        == best[s.labels.get("dp_rank", "")]
    ]


def _total(samples: list[_Sample] | None) -> float | None:
    if not samples:
        return None
    return float(sum(s.value for s in samples))


def _keyed(samples: list[_Sample] | None, key: str) -> dict[str, float] | None:
    if not samples:
        return None
    out: dict[str, float] = defaultdict(float)
    for s in samples:
        out[s.labels.get(key, "")] += s.value
    return dict(out)


# --- tolerant parsing -------------------------------------------------------------------------


def _only_read_families(text: str) -> tuple[set[str], str]:
    """(every family named by a TYPE line, the text with unread well-formed lines blanked).

    Lines are blanked, not removed, so parse errors keep the original line numbers; a garbled
    line is always kept, so it is still reported whichever family it belongs to.
    """
    typed: set[str] = set()
    out = text.split("\n")
    for i, line in enumerate(out):
        if not line:
            continue
        if line[0] == "#":
            header = _HEADER_RE.match(line)
            if header is None:
                continue
            name = header.group(2)
            if header.group(1) == "TYPE":
                kind = line.split()[-1] if len(line.split()) >= 4 else ""
                if kind == "counter" and not name.endswith("_total"):
                    name += "_total"
                if not name.endswith("_created"):
                    typed.add(name)
            if _family_of(header.group(2)) not in _WANTED:
                out[i] = ""
            continue
        m = _NAME_RE.match(line)
        if m and _family_of(m.group(1)) not in _WANTED and _SAMPLE_RE.match(line):
            out[i] = ""
    return typed, "\n".join(out)


def _family_of(sample_name: str) -> str:
    """A sample or header name as the family name READ_FAMILIES uses (counters keep _total)."""
    if sample_name.endswith("_total") or sample_name in _WANTED:
        return sample_name
    return sample_name + "_total" if sample_name + "_total" in _WANTED else sample_name

_Raw = tuple[str, dict[str, str], float]


def _parse_tolerant(text: str) -> tuple[set[str], list[_Raw], list[str]]:
    """(family names, samples, error lines). Fast path: the whole text parses in one go."""
    families: set[str] = set()
    samples: list[_Raw] = []
    try:
        _collect(text_string_to_metric_families(text), families, samples)
        return families, samples, []
    except Exception:  # noqa: BLE001 - any parser failure means "go slow", never "crash"
        families.clear()
        samples.clear()
    errors: list[str] = []
    dropped = [0]
    for start_line, block in _blocks(text):
        try:
            f: set[str] = set()
            s: list[_Raw] = []
            _collect(text_string_to_metric_families("\n".join(block) + "\n"), f, s)
            families |= f
            samples += s
            continue
        except Exception:  # noqa: BLE001
            pass
        headers = [ln for ln in block if _HEADER_RE.match(ln) and _HEADER_RE.match(ln).group(1) == "TYPE"]
        header = ""
        for h in headers:
            try:
                list(text_string_to_metric_families(h + "\n"))
                header = h + "\n"
            except Exception:  # noqa: BLE001
                pass
        for offset, line in enumerate(block):
            if not line.strip() or line.lstrip().startswith("#"):
                if line.startswith("# TYPE") and header != line + "\n":
                    _error(errors, dropped, start_line + offset, "bad TYPE line", line)
                continue
            try:
                _collect(text_string_to_metric_families(header + line + "\n"), families, samples)
            except Exception:  # noqa: BLE001
                _error(errors, dropped, start_line + offset, "unparsable sample", line)
    if dropped[0]:
        errors[-1] = f"... and {dropped[0] + 1} more garbled lines"
    return families, samples, errors


def _collect(fams: Iterable, families: set[str], samples: list[_Raw]) -> None:
    # Materialise first: the parser is lazy and may raise half-way through a family.
    for fam in list(fams):
        if fam.name.endswith("_created"):
            continue
        families.add(fam.name + "_total" if fam.type == "counter" else fam.name)
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            samples.append((s.name, dict(s.labels), float(s.value)))


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """Split into (first line number, lines) per family: a new HELP/TYPE name or a sample whose
    name does not extend the current family's name starts a new block."""
    blocks: list[tuple[int, list[str]]] = []
    current: str | None = None
    for no, line in enumerate(text.splitlines(), start=1):
        header = _HEADER_RE.match(line)
        if header:
            name = header.group(2)
            if name != current:
                current = name
                blocks.append((no, []))
        elif line.strip() and not line.lstrip().startswith("#"):
            m = _NAME_RE.match(line)
            name = m.group(1) if m else None
            if current is None or name is None or not name.startswith(current):
                current = name
                blocks.append((no, []))
        if not blocks:
            blocks.append((no, []))
        blocks[-1][1].append(line)
    return blocks


def _error(errors: list[str], dropped: list[int], line_no: int, what: str, line: str) -> None:
    if len(errors) >= MAX_ERRORS:
        dropped[0] += 1
        return
    shown = line.strip()
    if len(shown) > 60:
        shown = shown[:57] + "..."
    errors.append(f"line {line_no}: {what}: {shown!r}"[:MAX_ERROR_LEN])
