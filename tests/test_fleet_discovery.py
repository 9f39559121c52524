"""A fleet: targets from a real Prometheus's service discovery and from file_sd files, split
between exporter shards, and many simulated servers in one process (`sim --ports`).

The end-to-end tests run the Debian `prometheus` binary with a file_sd job that lists simulators,
and `hicache-canary serve` as its own process reading Prometheus's /api/v1/targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from hicache_canary.settings.config import ConfigError, Shard, load_settings
from hicache_canary.service.discovery import DiscoveryError
from hicache_canary.service.prometheus_sd import FileSDDiscovery, targets_from_api, targets_from_groups
from hicache_canary.service.scheduler import Scheduler
from hicache_canary.service.sharding import owner
import procs
from procs import Proc, canary_argv, free_port
from stack import start_prometheus


def api_target(instance: str, job: str = "sglang", scheme: str = "http", pool: str = "sglang") -> dict:
    return {"labels": {"instance": instance, "job": job}, "scrapePool": pool,
            "scrapeUrl": f"{scheme}://{instance}/metrics", "health": "up"}


# ------------------------------------------------------------------ parsing, no network


def test_prometheus_answer_gives_the_jobs_targets_named_by_instance():
    body = {"status": "success", "data": {"activeTargets": [
        api_target("10.0.0.5:30000"),
        api_target("gpu-b.example:30000", scheme="https"),
        api_target("10.0.0.9:9100", job="node"),  # another job: not ours
        {"labels": {"job": "sglang", "instance": "x:1"}, "scrapeUrl": "ftp://x:1/metrics"},
    ], "droppedTargets": []}}
    found, skipped = targets_from_api(body, "sglang", "instance")
    assert [(f.name, f.url) for f in found] == [("10.0.0.5-30000", "http://10.0.0.5:30000"),
                                                 ("gpu-b.example-30000", "https://gpu-b.example:30000")]
    assert len(skipped) == 1 and "must start with http:// or https://" in skipped[0]


@pytest.mark.parametrize("body,message", [
    pytest.param({"status": "error", "error": "bad_data: nope"}, "not a successful /api/v1/targets answer (bad_data: nope)", id="error-status"),
    pytest.param({"status": "success", "data": {}}, "no data.activeTargets list", id="no-active-targets"),
    pytest.param(["not", "a", "mapping"], "not a successful", id="not-a-mapping"),
    pytest.param({"status": "success", "data": {"activeTargets": [5]}}, "data.activeTargets[0] has no labels", id="garbled-target"),
])
def test_a_bad_prometheus_answer_is_an_error_naming_what_is_wrong(body, message):
    with pytest.raises(DiscoveryError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        targets_from_api(body, "sglang", "instance")


def test_file_sd_groups_give_targets_with_scheme_and_name_labels():
    doc = [{"targets": ["127.0.0.1:31000", "127.0.0.1:31001"], "labels": {"zone": "a"}},
           {"targets": ["gpu-c:30000"], "labels": {"__scheme__": "https", "instance": "gpu-c"}},
           {"targets": ["bad host:1", "127.0.0.1:31000/x"]}]
    found, skipped = targets_from_groups(doc, "t.json", "http", "instance")
    assert [(f.name, f.url) for f in found] == [("127.0.0.1-31000", "http://127.0.0.1:31000"),
                                                 ("127.0.0.1-31001", "http://127.0.0.1:31001"),
                                                 ("gpu-c", "https://gpu-c:30000")]
    assert len(skipped) == 2 and all(s.startswith("t.json [2].targets[") for s in skipped)


@pytest.mark.parametrize("doc,message", [
    pytest.param({"targets": ["a:1"]}, "t.json: must be a list of target groups", id="not-a-list"),
    pytest.param([{"targets": "a:1"}], r't.json: \[0\].targets must be a list of "host:port" strings', id="targets-not-a-list"),
    pytest.param([{"targets": ["a:1"], "labels": {"x": 1}}], r"t.json: \[0\].labels must map label names to strings", id="label-not-a-string"),
    pytest.param([{"targets": ["a:1"], "extra": 1}], r"t.json: \[0\] must be a mapping with only targets and labels", id="unknown-key"),
])
def test_a_bad_file_sd_document_is_an_error_naming_the_file_and_group(doc, message):
    with pytest.raises(DiscoveryError, match=message):
        targets_from_groups(doc, "t.json", "http", "instance")


async def test_a_bad_file_keeps_its_last_good_targets_and_says_why(tmp_path):
    f = tmp_path / "targets.json"
    f.write_text(json.dumps([{"targets": ["127.0.0.1:31000", "127.0.0.1:31001"]}]))
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"discovery:\n  file_sd: {{enabled: true, files: ['{tmp_path}/*.json'], refresh: 1h}}\n")
    s = load_settings(cfg, {})
    sched = Scheduler(s.targets, None, lambda t: None)
    disc = FileSDDiscovery(s, sched)
    assert [t.name for t in await disc.refresh()] == ["127.0.0.1-31000", "127.0.0.1-31001"]
    assert disc.status()["last_error"] is None

    f.write_text('[{"targets": ["127.0.0.1:31000"]')  # a half-written file
    assert [t.name for t in await disc.refresh()] == ["127.0.0.1-31000", "127.0.0.1-31001"]
    assert disc.status()["last_error"] == f"{f}: not valid JSON (line 1)"

    f.write_text(json.dumps([{"targets": ["127.0.0.1:31001"]}]))  # fixed, and one target gone
    assert [t.name for t in await disc.refresh()] == ["127.0.0.1-31001"]
    assert set(sched.snapshot()) == {"127.0.0.1-31001"} and disc.status()["last_error"] is None

    f.unlink()  # as in Prometheus: a file that is gone takes its targets with it
    assert await disc.refresh() == [] and "no file matches" in disc.status()["last_error"]


# ------------------------------------------------------------------ sharding


@pytest.mark.parametrize("raw,message", [
    pytest.param("2/2", "need 0 <= i < N", id="index-too-high"),
    pytest.param("1", "is not a shard (write i/N", id="no-count"),
    pytest.param("0/0", "need 0 <= i < N", id="zero-replicas"),
])
def test_a_bad_shard_is_a_config_error(tmp_path, raw, message):
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"shard: '{raw}'\ntargets: [{{name: a, url: 'http://127.0.0.1:1'}}]\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg, {})
    assert str(err.value).startswith("shard: ") and message in str(err.value)
    with pytest.raises(ConfigError) as err:  # the environment variable a StatefulSet would set
        load_settings(None, {"HICACHE_CANARY_TARGET_URL": "http://127.0.0.1:1", "HICACHE_CANARY_SHARD": raw})
    assert str(err.value).startswith("HICACHE_CANARY_SHARD: ")


def test_shard_from_the_environment_wins_over_the_file(tmp_path):
    cfg = tmp_path / "c.yml"
    cfg.write_text("shard: 0/3\ntargets: [{name: a, url: 'http://127.0.0.1:1'}]\n")
    assert load_settings(cfg, {}).shard == Shard(0, 3)
    assert load_settings(cfg, {"HICACHE_CANARY_SHARD": "2/3"}).shard == Shard(2, 3)


def test_ownership_is_stable_balanced_and_moves_little_when_a_replica_is_added():
    names = [f"sglang-{i}" for i in range(600)]
    # Fixed owners: a new release must not reshuffle a running fleet (every target would start over).
    assert [owner(f"sglang-{i}", 4) for i in range(6)] == [1, 3, 3, 0, 3, 2]
    counts = [sum(owner(n, 3) == i for n in names) for i in range(3)]
    assert min(counts) > 150, counts  # about 200 each
    moved = sum(owner(n, 3) != owner(n, 4) for n in names)
    assert moved < 600 * 0.35, moved  # about a quarter move to the new replica; hash % N would move ~3/4

# ------------------------------------------------------------------ real processes


def start_fleet_sim(n: int) -> tuple[Proc, list[int]]:
    """n simulated servers in one process (`sim --ports`), each on its own free port."""
    ports = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    proc = Proc("fleet-sim", canary_argv("sim", "--host", "127.0.0.1", "--ports", ",".join(map(str, ports)),
                                         "--time-scale", "0.002", "--enable-hierarchical-cache", "--enable-metrics",
                                         "--max-total-tokens", "40000"))
    for p in ports:
        proc.wait_http(f"http://127.0.0.1:{p}/health", ok=lambda r: r.status_code == 200)
    return proc, ports


def start_exporter(tmp_path: Path, name: str, body: str) -> tuple[Proc, str]:
    port = free_port()
    cfg = tmp_path / f"{name}.yml"
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {port}}}\n"
                   "defaults: {interval: 1h, context_tokens: 4096, watch_interval: 0, poll_interval: 0.05s, passive_wait: 0.1s}\n"
                   "probe_spacing: 0\n" + body)
    proc = Proc(name, canary_argv("serve", "--config", str(cfg)))
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/healthz", ok=lambda r: r.status_code == 200)
    return proc, url


def api(url: str) -> dict:
    return httpx.get(url + "/api/targets", timeout=5).json()


def names(url: str) -> set[str]:
    return {t["config"]["name"] for t in api(url)["targets"]}


def wait_for(cond, timeout: float, what: str, proc: Proc | None = None):
    return procs.wait_for(cond, timeout, what, every=0.2, proc=proc)


def write_sd(path: Path, ports: list[int]) -> None:
    tmp = path.with_suffix(".tmp")  # write-then-rename, as a file_sd producer must (no half-read file)
    tmp.write_text(json.dumps([{"targets": [f"127.0.0.1:{p}" for p in ports], "labels": {"env": "test"}}]))
    tmp.rename(path)


def test_targets_come_from_a_real_prometheus_and_follow_its_service_discovery(tmp_path):
    sim, ports = start_fleet_sim(3)
    sd = tmp_path / "sglang.json"
    write_sd(sd, ports)
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: sglang\n    file_sd_configs: [{{files: ['{sd}'], refresh_interval: 1s}}]\n"
        "  - job_name: other\n    static_configs: [{targets: ['127.0.0.1:1']}]\n")
    prom, prom_url = start_prometheus(prom_cfg)
    exp = None
    try:
        exp, url = start_exporter(tmp_path, "exporter-promsd",
                                  f"discovery:\n  prometheus: {{enabled: true, url: '{prom_url}', job: sglang, refresh: 0.5s}}\n")
        want = {f"127.0.0.1-{p}" for p in ports}
        wait_for(lambda: names(url) == want, 30, "the three simulators as targets", exp)
        t0 = api(url)["targets"][0]["config"]
        assert t0["source"] == "prometheus" and t0["url"].startswith("http://127.0.0.1:") and t0["context_tokens"] == 4096
        # and they are probed: the exporter reached the simulators Prometheus told it about
        wait_for(lambda: all(t["state"]["verdict"] == "reused" for t in api(url)["targets"]), 60, "a probe of each", exp)

        write_sd(sd, ports[:2])  # a server leaves the fleet
        wait_for(lambda: names(url) == want - {f"127.0.0.1-{ports[2]}"}, 30, "the removed target to go", exp)
        write_sd(sd, ports)  # and comes back
        wait_for(lambda: names(url) == want, 30, "the target to come back", exp)
        status = api(url)["discovery"]
        assert status[0]["source"] == "prometheus" and status[0]["targets"] == 3 and status[0]["last_error"] is None

        prom.stop()  # Prometheus gone: keep the last good list, and say why
        err = wait_for(lambda: api(url)["discovery"][0]["last_error"], 10, "the discovery error", exp)
        assert err.startswith(f"cannot reach Prometheus at {prom_url}: ConnectError")
        assert names(url) == want
        assert httpx.get(url + "/metrics").status_code == 200
        assert f"discovery (prometheus): cannot reach Prometheus at {prom_url}" in exp.log()
        assert "Traceback" not in exp.log()
    finally:
        for p in (exp, prom, sim):
            if p is not None:
                p.stop()


def test_two_shards_split_twenty_targets_with_no_overlap_and_no_gap(tmp_path):
    sim, ports = start_fleet_sim(20)
    sd = tmp_path / "sglang.json"
    write_sd(sd, ports)
    shards = []
    try:
        for i in range(2):
            shards.append(start_exporter(tmp_path, f"exporter-shard{i}",
                                         f"shard: {i}/2\ndiscovery:\n  file_sd: {{enabled: true, files: ['{sd}'], refresh: 0.5s}}\n"))
        (p0, u0), (p1, u1) = shards
        everyone = {f"127.0.0.1-{p}" for p in ports}
        wait_for(lambda: len(names(u0)) + len(names(u1)) == 20, 30, "both shards to discover their targets", p0)
        a, b = names(u0), names(u1)
        assert a & b == set(), "a target probed by both shards"
        assert a | b == everyone, "a target probed by no shard"
        assert 4 <= len(a) <= 16  # both shards have work (rendezvous hashing of 20 names)
        s0, s1 = api(u0)["shard"], api(u1)["shard"]
        assert (s0["shard"], s1["shard"]) == ("0/2", "1/2")
        assert set(s0["targets_on_other_shards"]) == b and set(s1["targets_on_other_shards"]) == a
        # each shard exports only its own targets
        text = httpx.get(u0 + "/metrics").text
        assert all(f'target="{n}"' not in text for n in b) and all(f'hicache_canary_up{{target="{n}"}}' in text or f'target="{n}"' in text for n in a)
    finally:
        for p, _ in shards:
            p.stop()
        sim.stop()


def test_bad_discovery_keys_are_config_errors_naming_the_key(tmp_path):
    cfg = tmp_path / "c.yml"
    cfg.write_text("discovery:\n  prometheus: {enabled: true, url: 'ftp://prom', job: ''}\n"
                   "  file_sd: {enabled: true, files: [], scheme: gopher}\n")
    with pytest.raises(ConfigError) as err:
        load_settings(cfg, {})
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["discovery.prometheus.url", "discovery.prometheus.job",
                                                      "discovery.file_sd.files", "discovery.file_sd.scheme"]
    assert lines[0] == "discovery.prometheus.url: must start with http:// or https://"


def test_discovery_alone_is_a_valid_config(tmp_path):
    cfg = tmp_path / "c.yml"
    cfg.write_text("discovery:\n  prometheus: {enabled: true, url: 'http://prom:9090', job: sglang, refresh: 15s}\n")
    s = load_settings(cfg, {})
    assert s.targets == () and s.prometheus_sd.job == "sglang" and s.prometheus_sd.refresh == 15 and s.probe_spacing == 1.0
