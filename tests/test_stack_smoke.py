"""The real Prometheus and Alertmanager binaries start and answer (proves the test stack works)."""

from pathlib import Path

from stack import WebhookReceiver, prom_query, start_alertmanager, start_prometheus


def test_prometheus_and_alertmanager_start_and_answer(tmp_path: Path):
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text("global: {scrape_interval: 1s}\nscrape_configs: []\n")
    with WebhookReceiver() as hook:
        am_cfg = tmp_path / "am.yml"
        am_cfg.write_text(f"route: {{receiver: hook}}\nreceivers: [{{name: hook, webhook_configs: [{{url: '{hook.url}/x'}}]}}]\n")
        prom, prom_url = start_prometheus(prom_cfg)
        am, am_url = start_alertmanager(am_cfg)
        try:
            assert prom_query(prom_url, "vector(1)")[0]["value"][1] == "1"
        finally:
            prom.stop()
            am.stop()
