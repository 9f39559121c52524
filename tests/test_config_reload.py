"""Which targets a config reload starts, stops and restarts (the SIGHUP itself: test_serve_e2e.py)."""

from __future__ import annotations

from dataclasses import replace

from hicache_canary.settings.config import load_settings
from hicache_canary.service.config_reload import target_changes


def test_added_removed_changed_and_unchanged_targets():
    env = {"HICACHE_CANARY_TARGET_URL": "http://127.0.0.1:9", "HICACHE_CANARY_TARGET_NAME": "a"}
    a = load_settings(None, env).targets[0]
    b, c = replace(a, name="b"), replace(a, name="c")
    changes = target_changes([a, b], [replace(a, interval_s=a.interval_s * 2), c])
    assert [t.name for t in changes.added] == ["c"]
    assert list(changes.removed) == ["b"]
    assert [(t.name, t.interval_s) for t in changes.changed] == [("a", a.interval_s * 2)]
    assert target_changes([a, b], [b, a]) == target_changes([], [])  # same targets, any order: nothing to do
