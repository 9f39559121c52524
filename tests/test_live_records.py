"""Records from live SGLang servers, judged again by today's rules (no GPU needed).

`conformance/run-*.tgz` are whole `bench/real_sglang.py` runs on a real SGLang 0.5.17 (see the
README beside them): seven servers, ten consecutive `probe --json` records each. Today's
verdict.decide must reach the verdict each record carries; a rule change that would flip a live
verdict fails here first.
"""

from __future__ import annotations

import json

import pytest

from fixtures import SGLANG, sglang_json
from hicache_canary.models import Phase, Verdict
from hicache_canary.probe.restarts import restart_reason, snapshot_reading
from hicache_canary.probe.verdict import decide
from live_records import record, records_in_archive

RUNS = sorted((SGLANG / "sglang-0.5.17-live" / "conformance").glob("run-*.tgz"))
LIVE = {f"{run.name}:{name}": d for run in RUNS for name, d in records_in_archive(run).items()}
BIG_CHUNK = sorted((SGLANG / "sglang-0.5.17-live" / "conformance" / "big-chunk").glob("*.json"))
LIVE.update({f"big-chunk/{f.name}": json.loads(f.read_text()) for f in BIG_CHUNK})


def test_the_live_runs_are_here_and_whole():
    assert RUNS, "no live conformance run in tests/testdata"
    servers = {name.split("/probes/")[1].split("/")[0] for name in LIVE if "/probes/" in name}
    assert {"wt", "wb", "wtsel", "nohicache", "wtsmall", "page64", "dense_wt"} <= servers
    assert len(LIVE) >= 140 and len(BIG_CHUNK) == 3


@pytest.mark.parametrize("name", sorted(LIVE))
def test_todays_rules_reach_the_live_verdict(name):
    d = LIVE[name]
    got = decide(record(d))
    assert (got.verdict.value, got.cause.value) == (d["verdict"], d["cause"]), got.evidence


@pytest.mark.parametrize("name", sorted(LIVE))
def test_every_live_probe_was_conclusive_and_never_claimed_an_eviction_it_did_not_get(name):
    d = LIVE[name]
    rec = record(d)
    assert rec.verdict in (Verdict.REUSED, Verdict.SILENT, Verdict.HICACHE_DISABLED), d["evidence"]
    rehost = rec.step(Phase.REHOST)
    if rec.pressure.eviction_confirmed and rehost is not None and rehost.cached is not None:
        assert rehost.cached.device < 64, f"eviction proven, yet R came back {rehost.cached.device} tokens from device"


def test_the_first_live_write_through_record_is_still_not_evicted():
    """The record that showed the bug: R came back from device; no rule may call that anything else."""
    d = sglang_json("sglang-0.5.17-live/consecutive-probes/probe_write_through_second.json")
    assert decide(record(d)).verdict == Verdict.NOT_EVICTED


@pytest.mark.parametrize("name", sorted(LIVE))
def test_the_restart_rule_sees_no_restart_in_a_live_probe(name):
    """The one restart rule (restarts.py) over every pair of consecutive snapshots a live probe took:
    these servers never restarted, so any reason it gives would have ended a good probe in error."""
    rec = record(LIVE[name])
    snaps = []
    for step in rec.steps:
        for snap in (step.before, step.after):
            if snap is not None and (not snaps or snap is not snaps[-1]) and snap.families:
                snaps.append(snap)
    for prev, now in zip(snaps, snaps[1:]):
        assert restart_reason(snapshot_reading(prev), snapshot_reading(now)) is None, (prev.taken_at, now.taken_at)
