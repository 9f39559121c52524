"""The restart watch's pure parts: reading SGLang's real /metrics, and what counts as a restart."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pytest

from hicache_canary.service.watch import WatchReading, WatchState, after_probe, delay_after_restart, observe, read_metrics, restarted, watch_period
from fixtures import sglang_text



def reading(start: float | None = None, **counters: float) -> WatchReading:
    return WatchReading(MappingProxyType(counters), start)


TOKENIZER = {"prompt_tokens_total", "generation_tokens_total", "num_requests_total", "cached_tokens_total"}


@pytest.mark.parametrize(
    "fixture,prompt,requests,radix",
    [
        pytest.param("sglang-0.5.23/metrics_write_through_silent.txt", 123690.0, 3.0,
                     {"evicted_tokens_total", "hicache_backup_tokens_total", "prefill_effective_tokens_total"}, id="0.5.23"),
        pytest.param("sglang-0.5.17-live/metrics_write_back_after_probe.txt", 94503.0, 37.0,
                     {"evicted_tokens_total", "load_back_tokens_total"}, id="0.5.17-live"),
    ],
)
def test_reads_the_restart_counters_of_real_sglang_output(fixture, prompt, requests, radix):
    r = read_metrics(sglang_text(fixture))
    assert r.counters["prompt_tokens_total"] == prompt
    assert r.counters["num_requests_total"] == requests
    assert set(r.counters) == TOKENIZER | radix  # the same counters the canary checks within a probe


def test_sums_children_and_reads_process_start_time_and_skips_garbage():
    text = "\n".join([
        '# TYPE sglang:prompt_tokens_total counter',
        'sglang:prompt_tokens_total{is_streaming="true",model_name="a}b"} 10.0',
        'sglang:prompt_tokens_total{is_streaming="false"} 5 1700000000000',
        'sglang:prompt_tokens_created{is_streaming="false"} 1.7e9',
        'sglang:num_requests_total{is_streaming="false"} not-a-number',
        'sglang:evicted_tokens_total{tp_rank="0"} 99',
        'sglang:evicted_tokens_total{tp_rank="1"} 99',
        'sglang:num_running_reqs{tp_rank="0"} 3',
        'process_start_time_seconds 1.7e9',
        'garbage',
        '',
    ])
    r = read_metrics(text)
    assert dict(r.counters) == {"prompt_tokens_total": 15.0, "evicted_tokens_total": 198.0}
    assert r.start_time == 1.7e9


@pytest.mark.parametrize(
    "prev,now,expected",
    [
        pytest.param(reading(prompt_tokens_total=100), reading(prompt_tokens_total=150), False, id="counters-grew"),
        pytest.param(reading(prompt_tokens_total=100), reading(prompt_tokens_total=40), True, id="counter-went-back"),
        pytest.param(reading(prompt_tokens_total=100), reading(), True, id="children-gone-on-a-fresh-process"),
        pytest.param(reading(), reading(prompt_tokens_total=5), False, id="first-requests-after-an-idle-start"),
        pytest.param(reading(1.0, prompt_tokens_total=1), reading(2.0, prompt_tokens_total=9), True, id="new-start-time"),
        pytest.param(reading(1.0), reading(1.0), False, id="same-process"),
        pytest.param(reading(evicted_tokens_total=900), reading(evicted_tokens_total=10, prompt_tokens_total=99), True,
                     id="a-radix-counter-went-back"),
    ],
)
def test_restarted(prev, now, expected):
    assert restarted(prev, now) is expected


def test_observe_sees_down_then_back_as_a_restart_once():
    s, hit = observe(WatchState(), reading(prompt_tokens_total=10), True)
    assert not hit and not s.down
    s, hit = observe(s, None, False)
    assert not hit and s.down
    s, hit = observe(s, None, False)
    assert not hit and s.down and s.reading == reading(prompt_tokens_total=10)  # the baseline survives
    s, hit = observe(s, reading(prompt_tokens_total=10), True)
    assert hit and not s.down
    s, hit = observe(s, reading(prompt_tokens_total=12), True)
    assert not hit


def test_observe_without_metrics_keeps_the_baseline_and_still_sees_back():
    s, _ = observe(WatchState(), reading(prompt_tokens_total=10), True)
    s, hit = observe(s, None, True)  # /metrics 404
    assert not hit and s.reading == reading(prompt_tokens_total=10)
    s, hit = observe(s, reading(prompt_tokens_total=3), True)
    assert hit


@pytest.mark.parametrize(
    "watch,interval,expected",
    [
        pytest.param(30, 900, 30, id="default-between-15m-probes"),
        pytest.param(0, 900, None, id="zero-disables"),
        pytest.param(60, 60, None, id="not-more-often-than-the-probes"),
    ],
)
def test_watch_period(watch, interval, expected):
    assert watch_period(watch, interval) == expected


def test_restart_delay_is_capped_at_the_interval():
    assert delay_after_restart(60, 900) == 60
    assert delay_after_restart(60, 20) == 20
    assert delay_after_restart(0, 900) == 0


def test_a_probe_seeds_the_baseline_so_a_restart_right_after_it_is_caught():
    s = after_probe(WatchState(), 57344.0, None, True)  # the watch never read: it pauses during probes
    s, hit = observe(s, reading(), True)  # the first read is from a fresh process
    assert hit


def test_a_probe_raises_but_never_lowers_the_baseline_and_clears_a_down():
    s, _ = observe(WatchState(), reading(prompt_tokens_total=100, num_requests_total=3), True)
    s, _ = observe(s, None, False)
    s = after_probe(s, 50.0, None, True)
    assert s.reading.counters == {"prompt_tokens_total": 100, "num_requests_total": 3} and not s.seen_down
    s, hit = observe(s, reading(prompt_tokens_total=120, num_requests_total=4), True)
    assert not hit  # the probe reached the server: coming "back" from that down is not a restart
    assert after_probe(s, None, None, False) == s
