"""Config: one invalid file per rule, each asserted by its exact one-line message; env overrides;
check-config and serve exit 2 with nothing but those lines (issue 4, issue 7's bad-config matrix)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hicache_canary.settings.config import ConfigError, load_settings, parse_duration
from procs import canary_argv

DATA = Path(__file__).parent / "testdata" / "config"

INVALID = [
    ("invalid-unknown-key.yml", "targets[0].intervall: unknown key"),
    ("invalid-bad-url-scheme.yml", "targets[1].url: must start with http:// or https://"),
    ("invalid-url-no-host.yml", "targets[0].url: has no host"),
    ("invalid-url-credentials.yml", "targets[0].url: must not contain credentials (use api_key_env or api_key_file)"),
    ("invalid-negative-context.yml", "targets[0].context_tokens: must be greater than 0"),
    ("invalid-zero-budget.yml", "defaults.token_budget_per_hour: must be greater than 0"),
    ("invalid-duration.yml", "targets[0].interval: '10 minutes' is not a duration (use 30s, 10m, 1h or a number of seconds)"),
    ("invalid-duplicate-names.yml", "targets[1].name: duplicate name 'a' (also targets[0])"),
    ("invalid-bad-name.yml", "targets[0].name: 'GPU 0' is not a valid name (use 1-63 of a-z 0-9 _ . -, starting with a letter or digit)"),
    ("invalid-no-targets.yml", "targets: at least one target is required (or set HICACHE_CANARY_TARGET_URL, or enable discovery.docker, discovery.prometheus or discovery.file_sd)"),
    ("invalid-key-file-unreadable.yml", "targets[0].api_key_file: cannot read /nonexistent/hicache-canary/sglang_api_key: No such file or directory"),
    ("invalid-key-env-and-file.yml", "targets[0]: set api_key_env or api_key_file, not both"),
    ("invalid-api-choice.yml", "targets[0].api: must be 'auto', 'native' or 'openai'"),
    ("invalid-port.yml", "listen.port: must be less than or equal to 65535"),
    ("invalid-discovery-key.yml", "discovery.docker.sockett: unknown key"),
    ("invalid-token-file-unreadable.yml", "probe_api_token_file: cannot read /nonexistent/hicache-canary/token: No such file or directory"),
    ("invalid-top-level-list.yml", "{path}: the top level must be a mapping, not list"),
    ("invalid-yaml-syntax.yml", "{path}: line 4: expected ',' or ']', but got '<stream end>'"),
]


def test_every_invalid_file_has_a_row():
    assert {f.name for f in DATA.glob("invalid-*.yml")} == {name for name, _ in INVALID}


@pytest.mark.parametrize("name,expected", INVALID, ids=[n.removeprefix("invalid-").removesuffix(".yml") for n, _ in INVALID])
def test_invalid_config_gives_one_line_naming_the_field(name: str, expected: str):
    path = DATA / name
    with pytest.raises(ConfigError) as err:
        load_settings(path, {})
    assert str(err.value) == expected.format(path=path)


def test_all_problems_reported_at_once(tmp_path: Path):
    doc = tmp_path / "all-wrong.yml"
    doc.write_text(
        "targets:\n  - {name: a, url: 'ftp://x', context_tokens: 0}\n  - {name: b, url: 'http://h:1', bogus: 1}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_settings(doc, {})
    assert err.value.problems == [
        "targets[0].context_tokens: must be greater than 0",
        "targets[0].url: must start with http:// or https://",
        "targets[1].bogus: unknown key",
    ]


def test_good_config_merges_defaults_and_resolves_the_key():
    s = load_settings(DATA / "good.yml", {"SGLANG_API_KEY": "sk-test-123", "HICACHE_CANARY_API_TOKEN": "tok"})
    a, b = s.targets
    assert (a.name, a.url, a.interval_s, a.token_budget_per_hour) == ("sglang-0", "http://127.0.0.1:30000", 600.0, 500000)
    assert (a.probe.context_tokens, a.probe.busy_queue_threshold, a.probe.busy_running_threshold, a.probe.api) == (8192, 3, 8, "native")
    assert a.api_key is not None and a.api_key.get_secret_value() == "sk-test-123"
    # sglang-1 sets nothing: defaults, then built-ins; the trailing slash goes
    assert (b.url, b.interval_s, b.probe.context_tokens, b.api_key) == ("https://gpu-node-2.internal:30000", 900.0, 16384, None)
    assert s.probe_api_token is not None and (s.listen_host, s.listen_port) == ("127.0.0.1", 9807)
    assert "sk-test-123" not in repr(s) and "sk-test-123" in s.secrets()
    assert "sk-test-123" not in str(a.summary())


def test_key_env_that_is_unset_is_an_error_but_empty_means_no_key():
    with pytest.raises(ConfigError, match=r"^targets\[0\]\.api_key_env: environment variable SGLANG_API_KEY is not set$"):
        load_settings(DATA / "good.yml", {})
    s = load_settings(DATA / "good.yml", {"SGLANG_API_KEY": ""})
    assert s.targets[0].api_key is None and s.probe_api_token is None  # token unset: probe API disabled


def test_key_file_is_read_and_stripped(tmp_path: Path):
    key = tmp_path / "k"
    key.write_text("sk-from-file\n")
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"defaults: {{api_key_file: {key}}}\ntargets:\n  - {{name: a, url: 'http://127.0.0.1:1'}}\n")
    assert load_settings(cfg, {}).targets[0].api_key.get_secret_value() == "sk-from-file"


def test_env_alone_makes_a_target_for_docker_compose():
    s = load_settings(None, {"HICACHE_CANARY_TARGET_URL": "http://sglang:30000", "HICACHE_CANARY_INTERVAL": "2m",
                             "HICACHE_CANARY_CONTEXT_TOKENS": "4096", "HICACHE_CANARY_LISTEN_PORT": "9900"})
    (t,) = s.targets
    assert (t.name, t.url, t.interval_s, t.probe.context_tokens, t.source, s.listen_port) == ("sglang", "http://sglang:30000", 120.0, 4096, "env", 9900)


def test_env_target_replaces_the_file_target_of_that_name():
    s = load_settings(DATA / "good.yml", {"SGLANG_API_KEY": "k", "HICACHE_CANARY_TARGET_URL": "http://other:30000",
                                          "HICACHE_CANARY_TARGET_NAME": "sglang-0", "HICACHE_CANARY_INTERVAL": "30s"})
    by = {t.name: t for t in s.targets}
    assert by["sglang-0"].url == "http://other:30000" and by["sglang-0"].probe.context_tokens == 8192
    assert {t.interval_s for t in s.targets} == {30.0}  # env wins over the file for every target


def test_bad_env_override_names_the_variable():
    with pytest.raises(ConfigError) as err:
        load_settings(None, {"HICACHE_CANARY_TARGET_URL": "sglang:30000", "HICACHE_CANARY_INTERVAL": "soon"})
    assert err.value.problems == [
        "HICACHE_CANARY_TARGET_URL: must start with http:// or https://",
        "HICACHE_CANARY_INTERVAL: 'soon' is not a duration (use 30s, 10m, 1h or a number of seconds)",
        "targets: at least one target is required (or set HICACHE_CANARY_TARGET_URL, or enable discovery.docker, discovery.prometheus or discovery.file_sd)",
    ]


@pytest.mark.parametrize(
    "value,seconds",
    [("30s", 30), ("10m", 600), ("1h", 3600), ("1h30m", 5400), ("500ms", 0.5), (15, 15), ("90", 90), (2.5, 2.5)],
    ids=str,
)
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["0s", -1, "1 h", "fast", True, None], ids=str)
def test_bad_durations(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_check_config_cli_exit_codes():
    bad = subprocess.run(canary_argv("check-config", str(DATA / "invalid-bad-url-scheme.yml")), capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr == "targets[1].url: must start with http:// or https://\n" and bad.stdout == ""
    good = subprocess.run(canary_argv("check-config", str(DATA / "good.yml")), capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "SGLANG_API_KEY": "sk-secret-999"})
    assert good.returncode == 0, good.stderr
    assert good.stdout.count("\n") == 1 and "2 target(s) (sglang-0, sglang-1)" in good.stdout
    assert "sk-secret-999" not in good.stdout + good.stderr


def test_serve_with_bad_config_exits_2_and_starts_nothing(tmp_path: Path):
    r = subprocess.run(canary_argv("serve", "--config", str(DATA / "invalid-duplicate-names.yml")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == "targets[1].name: duplicate name 'a' (also targets[0])\n"
    assert "Uvicorn running" not in r.stdout + r.stderr


def test_restart_watch_keys_default_to_30s_and_60s_and_take_zero(tmp_path: Path):
    doc = tmp_path / "watch.yml"
    doc.write_text(
        "defaults: {restart_probe_delay: 2m}\n"
        "targets:\n  - {name: a, url: 'http://h:1'}\n  - {name: b, url: 'http://h:2', watch_interval: 0, restart_probe_delay: 0s}\n"
    )
    a, b = load_settings(doc, {}).targets
    assert (a.watch_interval_s, a.restart_probe_delay_s) == (30.0, 120.0)
    assert (b.watch_interval_s, b.restart_probe_delay_s) == (0.0, 0.0)
    assert a.summary()["watch_interval_seconds"] == 30.0


def test_a_bad_watch_interval_is_one_line(tmp_path: Path):
    doc = tmp_path / "watch.yml"
    doc.write_text("targets:\n  - {name: a, url: 'http://h:1', watch_interval: -5s}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(doc, {})
    assert str(err.value) == "targets[0].watch_interval: '-5s' is not a duration (use 30s, 10m, 1h or a number of seconds)"


def test_docs_list_every_target_knob():
    """docs/configuration.md's target-key table names exactly the knobs a target accepts."""
    from hicache_canary.settings.target_knobs import KNOBS

    text = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    table = text.split("## Target keys", 1)[1].split("\n\n", 2)[1]
    documented = {k for row in table.splitlines()[2:] for k in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert documented == {"name", "url", "api_key_env", "api_key_file", *(k.key for k in KNOBS)}


def test_a_null_knob_means_its_default(tmp_path: Path):
    """`interval: null` (an empty value in YAML) ended in a TypeError traceback; it means "not set"."""
    cfg = tmp_path / "c.yml"
    cfg.write_text("defaults: {context_tokens: 8192}\n"
                   "targets:\n  - {name: a, url: 'http://127.0.0.1:1', interval:, context_tokens: null}\n")
    t = load_settings(cfg, {}).targets[0]
    assert (t.interval_s, t.probe.context_tokens) == (900.0, 8192)
