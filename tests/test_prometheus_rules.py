"""Prometheus and Alertmanager files under prometheus/, checked by the real promtool and amtool.

Runs `promtool check config` (the committed file and a rendered 127.0.0.1 copy), `promtool check
rules`, `promtool test rules`, `amtool check-config`, an `amtool config routes test` table, the
alert metadata contract (severity, summary, description, runbook_url -> docs/runbooks/<Alert>.md,
for:), and Alertmanager's inhibition of canary alerts by SGLangTargetDown on a real Alertmanager.

End-to-end tests reuse the two renderers here:
    render_prometheus_config(out_dir, exporter=..., sglang={name: "127.0.0.1:port"}, alertmanager=...)
    render_alertmanager_config(out_dir, {"pager_webhook_url": url, ...})
Both keep the rule files and alertmanager.yml verbatim; only addresses, intervals and secrets change.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from procs import REPO, require_binary
from fixtures import sglang_path

PROM_DIR = REPO / "prometheus"
RULE_FILES = sorted((PROM_DIR / "rules").glob("*.yml"))
TEST_FILES = sorted((PROM_DIR / "tests").glob("*.test.yml"))
ALERTMANAGER_YML = PROM_DIR / "alertmanager.yml"
RENDER_SCRIPT = PROM_DIR / "render-alertmanager-config.sh"
RUNBOOK_PREFIX = "https://github.com/hicache-canary/hicache-canary/blob/main/"
SEVERITIES = {"critical", "warning", "info", "none"}
SECRET_NAMES = ("pager_webhook_url", "chat_webhook_url", "heartbeat_webhook_url")


def render_prometheus_config(
    out_dir: Path,
    *,
    exporter: str,
    sglang: dict[str, str],
    alertmanager: str | None,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
) -> Path:
    """Write out_dir/prometheus.yml: the committed file with local addresses and short intervals.

    `sglang` maps target names (as in the exporter config) to host:port. Rule files are referenced
    by absolute path so the repository's rules are loaded verbatim.
    """
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = scrape_interval
    cfg["global"]["evaluation_interval"] = evaluation_interval
    cfg["rule_files"] = [str(PROM_DIR / pattern) for pattern in cfg["rule_files"]]
    if alertmanager:
        cfg["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
    else:
        cfg.pop("alerting")
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    for job in jobs.values():  # the compose demo's DNS discovery has nothing to find here
        job.pop("dns_sd_configs", None)
        job.pop("relabel_configs", None)
    jobs["hicache-canary"]["static_configs"] = [{"targets": [exporter]}]
    jobs["sglang"]["static_configs"] = [{"targets": [addr], "labels": {"target": name}} for name, addr in sglang.items()]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def render_alertmanager_config(out_dir: Path, urls: dict[str, str]) -> Path:
    """Write out_dir/alertmanager.yml via the same script compose runs, with `urls` as secret files."""
    secrets = out_dir / "secrets"
    secrets.mkdir(parents=True, exist_ok=True)
    for name, url in urls.items():
        (secrets / name).write_text(url + "\n")
    path = out_dir / "alertmanager.yml"
    subprocess.run(["sh", str(RENDER_SCRIPT), str(ALERTMANAGER_YML), str(path), str(secrets)], check=True, capture_output=True)
    return path


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)


def alert_rules() -> list[dict]:
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            rules += [r for r in group["rules"] if "alert" in r]
    return rules


def test_promtool_check_config_committed_and_rendered(tmp_path: Path):
    promtool = require_binary("promtool")
    committed = run([promtool, "check", "config", str(PROM_DIR / "prometheus.yml")])
    assert committed.returncode == 0, committed.stdout + committed.stderr
    rendered = render_prometheus_config(
        tmp_path, exporter="127.0.0.1:19807", sglang={"sim-wt": "127.0.0.1:31000", "sim-wb": "127.0.0.1:31001"}, alertmanager="127.0.0.1:19093"
    )
    result = run([promtool, "check", "config", str(rendered)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rule files found" in result.stdout
    cfg = yaml.safe_load(rendered.read_text())
    sglang_job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "sglang")
    assert [sc["labels"]["target"] for sc in sglang_job["static_configs"]] == ["sim-wt", "sim-wb"]
    assert "dns_sd_configs" not in sglang_job and "relabel_configs" not in sglang_job


def test_committed_scrape_config_targets_compose_services():
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in cfg["scrape_configs"]}
    assert jobs["hicache-canary"]["static_configs"][0]["targets"] == ["exporter:9807"]
    assert jobs["sglang"]["static_configs"] == [{"targets": ["host.docker.internal:30000"], "labels": {"target": "sglang"}}]
    assert cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    demo = yaml.safe_load((REPO / "deploy" / "hicache-canary.demo.yml").read_text())
    assert jobs["hicache-canary"]["dns_sd_configs"][0]["names"] == ["exporter-demo"]
    assert jobs["sglang"]["dns_sd_configs"][0]["names"] == ["simulator"]
    demo_target = jobs["sglang"]["relabel_configs"][0]
    assert (demo_target["target_label"], demo_target["replacement"]) == ("target", demo["targets"][0]["name"])


def test_promtool_check_rules():
    promtool = require_binary("promtool")
    result = run([promtool, "check", "rules", *map(str, RULE_FILES)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_rules_file_has_a_test_file_and_promtool_tests_pass():
    promtool = require_binary("promtool")
    stems = {p.name.removesuffix(".yml") for p in RULE_FILES}
    assert stems == {p.name.removesuffix(".test.yml") for p in TEST_FILES}
    result = run([promtool, "test", "rules", *map(str, TEST_FILES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(TEST_FILES)


def test_every_alert_has_the_mixin_metadata_and_a_runbook():
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {
        "HiCacheSilent",
        "HiCacheCanaryInconclusive",
        "HiCacheCanaryFailing",
        "HiCacheCanaryStale",
        "HiCacheWriteThroughOnHybridModel",
        "HiCacheHostTierNeverHit",
        "SGLangTargetDown",
        "HiCacheCanaryWatchdog",
    }
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"(HiCache|SGLang)[A-Z][A-Za-z]+", name), name
        assert "for" in rule, f"{name}: no for:"
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"].endswith("."), f"{name}: summary should be one sentence ending with a period"
        assert "{{" in notes["description"] or name == "HiCacheCanaryWatchdog", f"{name}: description has no values"
        url = notes["runbook_url"]
        assert url == f"{RUNBOOK_PREFIX}docs/runbooks/{name}.md", url
        assert (REPO / url.removeprefix(RUNBOOK_PREFIX)).is_file(), f"{name}: runbook missing"
    runbooks = {p.stem for p in (REPO / "docs" / "runbooks").glob("*.md")}
    assert runbooks == {r["alert"] for r in rules}, "every runbook belongs to an alert"


def test_every_alert_is_tested_firing_and_not_firing():
    fired, quiet = set(), set()
    for path in TEST_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in alert_rules()}
    assert names - fired == set(), "alerts never tested firing"
    assert names - quiet - {"HiCacheCanaryWatchdog"} == set(), "alerts never tested quiet"


def test_every_recording_rule_has_a_promql_expr_test():
    recorded = {r["record"] for p in RULE_FILES for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"] if "record" in r}
    tested = {
        check["expr"]
        for p in TEST_FILES
        for case in yaml.safe_load(p.read_text())["tests"]
        for check in case.get("promql_expr_test", [])
        if check.get("exp_samples")
    }
    assert recorded - tested == set()


def test_rules_use_only_contract_and_real_sglang_metric_names():
    readme = (REPO / "README.md").read_text()
    fixture = sglang_path("sglang-0.5.23/metrics_write_through_silent.txt")
    healthy = fixture.with_name("metrics_write_back_healthy.txt")
    real_text = fixture.read_text() + healthy.read_text()
    optional = {"hicache_canary_probe_interval_seconds"}  # used only with a fallback; see docs/alerts.md
    for path in RULE_FILES:
        text = path.read_text()
        exprs = " ".join(r["expr"] for g in yaml.safe_load(text)["groups"] for r in g["rules"])
        for name in set(re.findall(r"\bhicache_canary_[a-z_]+", exprs)) - optional:
            assert f"`{name}`" in readme or name.removesuffix("_total") in readme, f"{path.name}: {name} is not in the README contract"
        for name in set(re.findall(r"sglang:[a-z_]+", exprs)):
            assert name in real_text or name == "sglang:load_back_tokens_total", f"{path.name}: {name} not in SGLang 0.5.23 output"


def test_amtool_check_config_committed_and_rendered(tmp_path: Path):
    amtool = require_binary("amtool")
    committed = run([amtool, "check-config", str(ALERTMANAGER_YML)])
    assert committed.returncode == 0, committed.stdout + committed.stderr
    rendered = render_alertmanager_config(tmp_path, {n: f"http://127.0.0.1:9/{n}" for n in SECRET_NAMES})
    text = rendered.read_text()
    assert not re.search(r"secret\.invalid/\w", text) and "http://127.0.0.1:9/pager_webhook_url" in text
    result = run([amtool, "check-config", str(rendered)])
    assert result.returncode == 0, result.stdout + result.stderr


ROUTES = [
    ({"alertname": "HiCacheSilent", "severity": "critical", "target": "sglang-0", "cause": "mamba_state_not_backed_up"}, "pager"),
    ({"alertname": "SGLangTargetDown", "severity": "critical", "target": "sglang-0"}, "pager"),
    ({"alertname": "HiCacheCanaryInconclusive", "severity": "warning", "target": "sglang-0"}, "chat"),
    ({"alertname": "HiCacheCanaryFailing", "severity": "warning", "target": "sglang-0", "reason": "timeout"}, "chat"),
    ({"alertname": "HiCacheCanaryStale", "severity": "warning", "job": "hicache-canary"}, "chat"),
    ({"alertname": "HiCacheHostTierNeverHit", "severity": "warning", "target": "sglang-0"}, "chat"),
    ({"alertname": "HiCacheWriteThroughOnHybridModel", "severity": "info", "target": "sglang-0"}, "null"),
    ({"alertname": "HiCacheCanaryWatchdog", "severity": "none"}, "heartbeat"),
    ({"alertname": "SomethingElse"}, "chat"),  # no severity: visible rather than lost
]


@pytest.mark.parametrize("labels,receiver", ROUTES, ids=[f"{l['alertname']}-{r}" for l, r in ROUTES])
def test_amtool_routes(labels: dict[str, str], receiver: str):
    amtool = require_binary("amtool")
    argv = [amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_YML}", f"--verify.receivers={receiver}"]
    result = run(argv + [f"{k}={v}" for k, v in labels.items()])
    assert result.returncode == 0, f"{labels} -> {result.stdout.strip()} (expected {receiver})"


def test_render_script_rejects_a_bad_url_and_keeps_placeholders_for_missing_ones(tmp_path: Path):
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "pager_webhook_url").write_text("  http://127.0.0.1:5001/page?x=1&y=2  \n")
    out = tmp_path / "am.yml"
    ok = subprocess.run(["sh", str(RENDER_SCRIPT), str(ALERTMANAGER_YML), str(out), str(secrets)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "url: 'http://127.0.0.1:5001/page?x=1&y=2'" in out.read_text()
    assert "https://secret.invalid/chat_webhook_url" in out.read_text()
    assert "chat_webhook_url missing or empty" in ok.stderr
    (secrets / "chat_webhook_url").write_text("http://x/'; rm -rf /\n")
    bad = subprocess.run(["sh", str(RENDER_SCRIPT), str(ALERTMANAGER_YML), str(tmp_path / "bad.yml"), str(secrets)], capture_output=True, text=True)
    assert bad.returncode != 0
    assert "chat_webhook_url is not an http(s) URL" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "bad.yml").exists()


def test_target_down_inhibits_canary_alerts_of_the_same_target_in_alertmanager(tmp_path: Path):
    """amtool cannot test inhibition, so post alerts to a real Alertmanager and read their state."""
    from stack import start_alertmanager

    config = render_alertmanager_config(tmp_path, {n: f"http://127.0.0.1:9/{n}" for n in SECRET_NAMES})
    am, url = start_alertmanager(config, name="am-inhibit")
    try:
        def alert(name: str, severity: str, **labels: str) -> dict:
            return {"labels": {"alertname": name, "severity": severity, **labels}, "annotations": {"summary": "test"}}

        posted = [
            alert("SGLangTargetDown", "critical", target="down-0"),
            alert("HiCacheCanaryFailing", "warning", target="down-0", reason="connect_failed"),
            alert("HiCacheSilent", "critical", target="down-0", cause="unknown"),
            alert("HiCacheCanaryFailing", "warning", target="up-1", reason="timeout"),
            alert("HiCacheCanaryWatchdog", "none"),
        ]
        assert httpx.post(f"{url}/api/v2/alerts", json=posted, timeout=5).status_code == 200
        expected = {
            ("SGLangTargetDown", "down-0"): "active",
            ("HiCacheCanaryFailing", "down-0"): "suppressed",
            ("HiCacheSilent", "down-0"): "suppressed",
            ("HiCacheCanaryFailing", "up-1"): "active",
            ("HiCacheCanaryWatchdog", None): "active",
        }
        deadline = time.monotonic() + 15
        while True:
            got = {
                (a["labels"]["alertname"], a["labels"].get("target")): a["status"]["state"]
                for a in httpx.get(f"{url}/api/v2/alerts", timeout=5).json()
            }
            if got == expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == expected
    finally:
        am.stop()


def test_real_prometheus_loads_the_rules_and_the_watchdog_reaches_the_heartbeat_receiver(tmp_path: Path):
    """The rendered configs in the real binaries: every rule evaluates cleanly, the exporter being
    down shows up as HiCacheCanaryStale, and the watchdog arrives at the heartbeat webhook."""
    import tempfile

    from procs import Proc, free_port
    from stack import WebhookReceiver, prom_query, start_alertmanager

    with WebhookReceiver() as hook:
        am_cfg = render_alertmanager_config(tmp_path / "am", {n: f"{hook.url}/{n}" for n in SECRET_NAMES})
        am = prom = None
        try:
            am, am_url = start_alertmanager(am_cfg, name="am-rules")
            nobody = f"127.0.0.1:{free_port()}"  # nothing listens: the exporter and SGLang are "down"
            prom_cfg = render_prometheus_config(
                tmp_path / "prom", exporter=nobody, sglang={"sglang-0": nobody}, alertmanager=am_url.removeprefix("http://")
            )
            # Prometheus drops the first notification if it fires before Alertmanager is discovered and
            # resends only after --rules.alert.resend-delay (1m by default): shorten it for the watchdog.
            port = free_port()
            prom = Proc("prom-rules", [
                require_binary("prometheus"), f"--config.file={prom_cfg}", f"--storage.tsdb.path={tempfile.mkdtemp(prefix='prom-data-')}",
                f"--web.listen-address=127.0.0.1:{port}", "--rules.alert.resend-delay=1s",
            ])
            prom_url = f"http://127.0.0.1:{port}"
            prom.wait_http(prom_url + "/-/ready", timeout=60, ok=lambda r: r.status_code == 200)
            beat = hook.wait_for(lambda a: a["labels"].get("alertname") == "HiCacheCanaryWatchdog", 30, "watchdog heartbeat")
            assert beat["status"] == "firing"
            assert [p for p, _, _ in hook.notifications if p != "/heartbeat_webhook_url"] == []
            deadline = time.monotonic() + 20
            while True:
                groups = httpx.get(prom_url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                if all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rules):
                    break
                assert time.monotonic() < deadline, "rules never evaluated"
                time.sleep(0.2)
            assert len(rules) == 27
            assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
            pending = prom_query(prom_url, 'ALERTS{alertname="HiCacheCanaryStale"}')
            assert [(a["metric"]["alertstate"], a["metric"]["instance"]) for a in pending] == [("pending", nobody)]
        finally:
            for proc in (prom, am):
                if proc:
                    proc.stop()
