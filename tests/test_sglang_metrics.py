"""sglang_metrics.parse_snapshot against real SGLang output (0.5.23, live 0.5.17) and edge cases.

The real expositions live in tests/testdata/sglang (SGLang's own output, see its README); hand-made broken or
unusual ones in tests/testdata/metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_canary.models import CounterSnapshot
from hicache_canary.probe.sglang_metrics import MAX_ERROR_LEN, MAX_ERRORS, looks_like_router, parse_snapshot
from fixtures import sglang_text

REPO = Path(__file__).resolve().parents[1]
TESTDATA = Path(__file__).parent / "testdata" / "metrics"


fixture = sglang_text


def test_0523_write_through_silent_reads_one_tp_rank_and_leaves_load_back_absent():
    snap = parse_snapshot(fixture("sglang-0.5.23/metrics_write_through_silent.txt"), taken_at=12.5)
    assert snap.taken_at == 12.5
    assert snap.host_used_tokens == 592658
    assert snap.host_total_tokens == 709577
    assert snap.host_mamba_used_states == 4
    assert snap.host_mamba_total_states == 30
    # TP=2 repeats the radix counters: 600112 per rank, never 1200224.
    assert snap.backup_tokens == {"kv": 600112, "mamba": 6}
    assert snap.evicted_tokens == 452608
    assert snap.load_back_tokens is None  # nothing loaded back yet: absent, not 0
    assert snap.dropped_tokens is None
    # tp_rank 1 emits zeros for the scheduler's counter; the stats rank is tp_rank 0.
    assert snap.prefill_effective_tokens == {"input": 124040, "device_hit": 42240, "host_hit": 0, "storage_hit": 0}
    assert snap.cached_tokens == {"device": 41216}
    assert snap.prompt_tokens == 123690
    assert snap.num_running_reqs == 1
    assert snap.num_queue_reqs == 0
    assert snap.kv_available_tokens == 297074
    assert snap.kv_evictable_tokens == 61440
    assert snap.max_total_num_tokens == 400000
    assert snap.parse_errors == ()
    assert {"hicache_backup_tokens_total", "evicted_tokens_total", "hicache_host_used_tokens"} <= snap.families
    assert "load_back_tokens_total" not in snap.families
    assert not any(f.startswith("sglang") or f.endswith("_created") for f in snap.families)
    assert not looks_like_router(snap)


def test_0523_write_back_healthy_shows_load_back_and_host_hits():
    snap = parse_snapshot(fixture("sglang-0.5.23/metrics_write_back_healthy.txt"))
    assert snap.load_back_tokens == {"kv": 40960, "mamba": 3}
    assert snap.backup_tokens == {"kv": 521216, "mamba": 19}
    assert snap.cached_tokens == {"device": 41472, "host": 40960}
    assert snap.prefill_effective_tokens["host_hit"] == 40960
    assert snap.host_used_tokens == 486725
    assert snap.host_mamba_used_states == 22
    assert snap.evicted_tokens == 468992


@pytest.mark.parametrize("policy,host_used", [("write_through", 78464), ("write_back", 60608)])
def test_0517_live_shape_without_pool_or_rank_labels(policy, host_used):
    snap = parse_snapshot(fixture(f"sglang-0.5.17-live/metrics_{policy}_after_probe.txt"))
    assert snap.host_used_tokens == host_used
    assert snap.host_total_tokens == 96001
    assert snap.load_back_tokens == {"": 7424}  # no pool label in 0.5.17: keyed ""
    assert snap.evicted_tokens == 62118
    assert snap.backup_tokens is None  # family did not exist yet
    assert snap.prefill_effective_tokens is None
    assert snap.host_mamba_used_states is None
    assert snap.cached_tokens == {"host": 7424, "device": 7424}
    assert snap.prompt_tokens == 94503
    assert snap.max_total_num_tokens == 24000
    assert snap.kv_available_tokens == 192
    assert snap.parse_errors == ()


def test_dp_ranks_are_separate_caches_and_tp_ranks_are_copies():
    snap = parse_snapshot((TESTDATA / "dp2_tp2.txt").read_text())
    assert snap.backup_tokens == {"kv": 1000 + 250}  # one TP rank per DP rank, summed over DP
    assert snap.dropped_tokens == {"host_pressure": 64 + 2 + 32}  # keyed by reason, summed over pool
    assert snap.num_queue_reqs == 3 + 4
    assert snap.host_used_tokens == 5000 + 7000
    # Tokenizer counters carry no rank: every child with the same key adds up.
    assert snap.cached_tokens == {"host": 120, "storage_HiCacheFile": 8}
    assert snap.process_start_time == 1.7e9
    assert "hicache_backup_tokens_created" not in snap.families


def test_unlabelled_tokenizer_counters_key_empty_string():
    snap = parse_snapshot((TESTDATA / "legacy_unlabelled.txt").read_text())
    assert snap.cached_tokens == {"": 312}
    assert snap.prompt_tokens == 1500
    assert snap.evicted_tokens == 4096
    assert snap.host_used_tokens is None


def test_router_underscore_names_parse_and_are_flagged():
    snap = parse_snapshot((TESTDATA / "router_underscore.txt").read_text())
    assert looks_like_router(snap)
    assert snap.host_used_tokens == 1234
    assert snap.num_queue_reqs == 2
    assert snap.load_back_tokens == {"kv": 512}
    assert "hicache_host_used_tokens" in snap.families


def test_colon_names_win_over_underscore_duplicates():
    text = (
        'sglang:num_queue_reqs{tp_rank="0"} 1\n'
        'sglang_num_queue_reqs{tp_rank="0"} 9\n'
    )
    snap = parse_snapshot(text)
    assert snap.num_queue_reqs == 1
    assert not looks_like_router(snap)


def test_garbled_lines_are_reported_and_everything_else_kept():
    snap = parse_snapshot((TESTDATA / "garbled.txt").read_text())
    assert snap.num_queue_reqs == 5
    assert snap.host_total_tokens == 9000
    assert snap.kv_available_tokens == 42  # after the garbage, parsing goes on
    assert snap.backup_tokens["kv"] == 700
    assert snap.host_used_tokens is None  # its only sample was garbled: unknown, not 0
    assert len(snap.parse_errors) == 3
    assert snap.parse_errors[0].startswith("line 6: unparsable sample")
    assert "line 13" in snap.parse_errors[1]
    assert "line 15" in snap.parse_errors[2]


def test_parse_errors_are_bounded_in_number_and_length():
    good = 'sglang:num_queue_reqs{tp_rank="0"} 4\n'
    bad = "".join(f'sglang:junk_{i}{{a="{"x" * 500} nonsense\n' for i in range(50))
    snap = parse_snapshot(good + bad)
    assert snap.num_queue_reqs == 4
    assert len(snap.parse_errors) == MAX_ERRORS
    assert all(len(e) <= MAX_ERROR_LEN for e in snap.parse_errors)
    assert snap.parse_errors[-1] == "... and 41 more garbled lines"


@pytest.mark.parametrize("text", ["", "\n\n", "# just a comment\n", "<html>502 Bad Gateway</html>", "\x00\xff" * 100])
def test_empty_or_non_prometheus_bodies_give_all_none(text):
    snap = parse_snapshot(text)
    assert isinstance(snap, CounterSnapshot)
    assert snap.host_used_tokens is None and snap.backup_tokens is None and snap.cached_tokens is None
