"""Issue 5, end to end: a silent HiCache server pages, a healthy one never does, probes cut short
do not clear the page, a fix resolves it within about a minute, and a server that goes down pages
once while its canary alerts are inhibited.

Real processes only (tests/e2e_stack.py): simulators, `hicache-canary serve`, Prometheus with the
shipped rule files and Alertmanager with the shipped routing and timing (pager group_wait 10s,
group_interval 1m), a webhook receiver as pager and chat. Probe interval 3 s (confirm_after 1s),
scrape/evaluation 1 s; the rules' `for:` are the shipped ones. The stopped server is stopped as soon
as it has paged, so its SGLangTargetDown `for: 2m` runs while the silent server is being fixed: the
file takes about three minutes.
"""

from __future__ import annotations

import time

import pytest
import yaml

from e2e_stack import CHAT, DOOMED, HEALTHY, PAGER, SILENT, acquire_shared_stack, release_shared_stack, stop_doomed_after_its_page
from procs import REPO

# The simulator's default hybrid failure, which the canary's counter rules must name.
EXPECTED_CAUSE = "mamba_state_not_backed_up"


def shipped_for(alert: str) -> float:
    from hicache_canary.settings.config import parse_duration

    for group in yaml.safe_load((REPO / "prometheus/rules/hicache-canary.alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                return parse_duration(rule["for"], allow_zero=True)
    raise AssertionError(f"{alert} not in the shipped rules")


@pytest.fixture(scope="session")
def stack():
    s = acquire_shared_stack()
    yield s
    release_shared_stack()


def _pager_for(stack, target: str, **match) -> list:
    return stack.notifications(PAGER, target=target, **match)


def test_silent_server_pages_with_its_cause_errors_keep_it_and_the_fix_resolves_within_a_minute(stack):
    for_s = shipped_for("HiCacheSilent")
    alert, paged_at = stack.wait_notification(PAGER, 240, alertname="HiCacheSilent", target=SILENT, status="firing")
    detection = paged_at - stack.started
    print(f"\nHiCacheSilent detection: {detection:.1f} s from the silent server up to the page "
          f"(probe interval 3 s, confirm_after 1s, for: {for_s:g}s, pager group_wait 10s)")
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["cause"] == EXPECTED_CAUSE
    assert f"Suspected cause: {EXPECTED_CAUSE}" in alert["annotations"]["description"]
    assert alert["annotations"]["runbook_url"].endswith("docs/runbooks/HiCacheSilent.md")
    # The page arrives through the shipped `for:`, never before it.
    assert detection >= for_s
    # doomed (1h interval) got its second silent probe from the exporter's confirmation alone.
    assert stack.value(f'sum(hicache_canary_probes_total{{target="{DOOMED}"}})') == 2
    stop_doomed_after_its_page(stack)  # SGLangTargetDown's 2m start now; the next test checks it

    # write_back, probed by the same exporter, was reused all along and never paged.
    assert stack.value(f'max_over_time(hicache_canary_verdict{{target="{HEALTHY}",verdict="reused"}}[10m])') == 1
    assert stack.value(f'max_over_time(hicache_canary_verdict{{target="{HEALTHY}",verdict="silent"}}[10m])') == 0
    assert _pager_for(stack, HEALTHY) == []

    # Probes that end in error (a garbled server, like one cut short by a restart) say nothing
    # about HiCache: the page stays, with its cause, and nothing resolves or re-pages.
    errors_from = time.monotonic()
    stack.set_faults(SILENT, malformed_json=True)
    # Three in a row: the rules (1 s evaluation) have seen error verdicts for seconds by then.
    stack.wait_value(f'hicache_canary_consecutive_errors{{target="{SILENT}"}}', lambda v: v >= 3, 60, "three error probes")
    assert stack.value(f'hicache_canary_verdict{{target="{SILENT}",verdict="error"}}') == 1
    firing = stack.query(f'ALERTS{{alertname="HiCacheSilent",alertstate="firing",target="{SILENT}"}}')
    assert [a["metric"]["cause"] for a in firing] == [EXPECTED_CAUSE]
    # Had any evaluation since the page dropped it, it would have gone back through `pending`.
    since_page = f"{int(time.monotonic() - paged_at) + 1}s"
    assert stack.query(f'ALERTS{{alertname="HiCacheSilent",alertstate="pending",target="{SILENT}"}}[{since_page}]') == []
    assert _pager_for(stack, SILENT, alertname="HiCacheSilent", status="resolved", after=errors_from) == []
    stack.set_faults(SILENT, malformed_json=False)

    # The operator's fix: restart the same server with --hicache-write-policy write_back.
    fixed_at = stack.restart_sim(SILENT, "--hicache-write-policy", "write_back")
    resolved, resolved_at = stack.wait_notification(
        PAGER, 150, alertname="HiCacheSilent", target=SILENT, status="resolved", after=fixed_at
    )
    assert resolved["labels"]["cause"] == EXPECTED_CAUSE
    # Only a conclusive `reused` verdict resolves it (a probe the restart cut short does not).
    assert stack.value(f'hicache_canary_last_conclusive_verdict{{target="{SILENT}",verdict="reused"}}') == 1
    stack.wait_value(f'hicache_canary_verdict_streak{{target="{SILENT}"}} and on (target) hicache_canary_last_conclusive_verdict{{verdict="reused"}} == 1',
                     lambda v: v >= 2, 60, "two reused probes after the fix")
    resolution = resolved_at - fixed_at
    print(f"HiCacheSilent resolution: {resolution:.1f} s from the restart with write_back to the resolved notification "
          f"(shipped pager group_interval 1m); {time.monotonic() - fixed_at:.1f} s to two reused verdicts")
    # Within the pager's 1m group_interval plus a probe and an evaluation; the root's 5m would miss it.
    assert resolution < 80
    assert stack.query(f'ALERTS{{alertname="HiCacheSilent",target="{SILENT}"}}') == []
    assert _pager_for(stack, SILENT, alertname="HiCacheSilent", status="firing", after=errors_from) == []
    assert _pager_for(stack, HEALTHY) == []


def test_stopped_server_pages_as_down_and_its_canary_alerts_are_inhibited(stack):
    # doomed had two silent probes at stack start (and no probes since: 1h interval): it has paged
    # HiCacheSilent, and that alert keeps firing in Prometheus after the server stops.
    stopped_at = stop_doomed_after_its_page(stack)

    down, down_at = stack.wait_notification(PAGER, 240, alertname="SGLangTargetDown", target=DOOMED, status="firing", after=stopped_at)
    print(f"\nSGLangTargetDown: {down_at - stopped_at:.1f} s from the stop to the page (for: 2m, group_wait 10s)")
    assert down["labels"]["severity"] == "critical"
    assert down["annotations"]["runbook_url"].endswith("docs/runbooks/SGLangTargetDown.md")

    # Prometheus still fires HiCacheSilent for doomed; Alertmanager holds it back behind the down page.
    firing = stack.query(f'ALERTS{{alertname="HiCacheSilent",alertstate="firing",target="{DOOMED}"}}')
    assert firing, "HiCacheSilent for the stopped server should still be firing in Prometheus"
    deadline = time.monotonic() + 15
    while True:
        states = {
            a["labels"]["alertname"]: (a["status"]["state"], a["status"]["inhibitedBy"])
            for a in stack.am_alerts()
            if a["labels"].get("target") == DOOMED
        }
        if states.get("HiCacheSilent", ("",))[0] == "suppressed" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert states["SGLangTargetDown"][0] == "active"
    assert states["HiCacheSilent"][0] == "suppressed" and states["HiCacheSilent"][1], states

    # Nothing canary-shaped about doomed reached any receiver while it was down.
    for path in (PAGER, CHAT):
        for name in ("HiCacheSilent", "HiCacheCanaryFailing"):
            assert stack.notifications(path, alertname=name, target=DOOMED, status="firing", after=stopped_at) == []
    assert _pager_for(stack, HEALTHY) == []
