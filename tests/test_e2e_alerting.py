"""Issue 5, end to end: a silent HiCache server pages, a healthy one never does, a fix resolves it,
and a server that goes down pages once while its canary alerts are inhibited.

Real processes only (tests/e2e_stack.py): simulators, `hicache-canary serve`, Prometheus with the
shipped rule files and Alertmanager with the shipped routing, a webhook receiver as pager and chat.
Probe interval 3 s, scrape/evaluation 1 s; the rules' `for:` (HiCacheSilent 1m, SGLangTargetDown
2m) are the shipped ones, so this file takes about three and a half minutes.
"""

from __future__ import annotations

import time

import pytest

from e2e_stack import CHAT, DOOMED, HEALTHY, PAGER, SILENT, acquire_shared_stack, release_shared_stack

# The simulator's default hybrid failure, which the canary's counter rules must name.
EXPECTED_CAUSE = "mamba_state_not_backed_up"


@pytest.fixture(scope="session")
def stack():
    s = acquire_shared_stack()
    yield s
    release_shared_stack()


def _pager_for(stack, target: str, **match) -> list:
    return stack.notifications(PAGER, target=target, **match)


def test_silent_server_pages_with_its_cause_healthy_never_pages_and_the_fix_resolves(stack):
    alert, paged_at = stack.wait_notification(PAGER, 240, alertname="HiCacheSilent", target=SILENT, status="firing")
    detection = paged_at - stack.started
    print(f"\nHiCacheSilent detection: {detection:.1f} s from the silent server up to the page "
          f"(probe interval 3 s, for: 1m, pager group_wait 10s)")
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["cause"] == EXPECTED_CAUSE
    assert f"Suspected cause: {EXPECTED_CAUSE}" in alert["annotations"]["description"]
    assert alert["annotations"]["runbook_url"].endswith("docs/runbooks/HiCacheSilent.md")
    # The page arrives through the shipped `for: 1m`, never before it.
    assert detection >= 60

    # write_back, probed by the same exporter, was reused all along and never paged.
    assert stack.value(f'max_over_time(hicache_canary_verdict{{target="{HEALTHY}",verdict="reused"}}[10m])') == 1
    assert stack.value(f'max_over_time(hicache_canary_verdict{{target="{HEALTHY}",verdict="silent"}}[10m])') == 0
    assert _pager_for(stack, HEALTHY) == []

    # The operator's fix: restart the same server with --hicache-write-policy write_back.
    fixed_at = stack.restart_sim(SILENT, "--hicache-write-policy", "write_back")
    resolved, resolved_at = stack.wait_notification(
        PAGER, 120, alertname="HiCacheSilent", target=SILENT, status="resolved", after=fixed_at
    )
    assert resolved["labels"]["cause"] == EXPECTED_CAUSE
    # The page resolves as soon as the last probe is not silent, which may be a probe the restart cut
    # short (error: server_restarted); what matters to on-call is that the server then proves
    # healthy and the page stays resolved.
    stack.wait_value(f'hicache_canary_verdict_streak{{target="{SILENT}"}} and on (target) hicache_canary_verdict{{verdict="reused"}} == 1',
                     lambda v: v >= 2, 60, "two reused probes after the fix")
    healthy_at = time.monotonic()
    print(f"HiCacheSilent resolution: {resolved_at - fixed_at:.1f} s from the restart with write_back to the "
          f"resolved notification (Alertmanager group_interval shortened to 2s); {healthy_at - fixed_at:.1f} s "
          f"to two reused verdicts")
    assert stack.query(f'ALERTS{{alertname="HiCacheSilent",target="{SILENT}"}}') == []
    assert _pager_for(stack, SILENT, alertname="HiCacheSilent", status="firing", after=fixed_at) == []
    assert _pager_for(stack, HEALTHY) == []


def test_stopped_server_pages_as_down_and_its_canary_alerts_are_inhibited(stack):
    # doomed had two silent probes at stack start (and no probes since: 1h interval): it has paged
    # HiCacheSilent, and that alert keeps firing in Prometheus after the server stops.
    stack.wait_notification(PAGER, 240, alertname="HiCacheSilent", target=DOOMED, status="firing")
    stopped_at = stack.stop_sim(DOOMED)

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
