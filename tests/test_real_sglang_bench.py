"""bench/real_sglang.py on a CPU: its expectation table, its judging of real probe records, the exporter
config it writes, and its orchestration end to end with the simulator standing in for SGLang.

The GPU run itself is the operator's (docs/real-sglang.md); nothing here claims its results. What a CPU
can prove is that the script judges SGLang's real records the way the issue says they must be judged
(the 0.5.17 write_through records of issue 11 are FAILs: `not_evicted`, eviction "confirmed" while R
stayed on device) and that the start/probe/serve/stop plumbing works before GPU time is spent on it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import tarfile

import pytest
import yaml

from fixtures import sglang_json, sglang_text
from procs import REPO, canary_argv

spec = importlib.util.spec_from_file_location("real_sglang", REPO / "bench" / "real_sglang.py")
rs = importlib.util.module_from_spec(spec)
sys.modules["real_sglang"] = rs
spec.loader.exec_module(rs)

LIVE = "sglang-0.5.17-live/consecutive-probes/"
WT_SECOND = sglang_json(LIVE + "probe_write_through_second.json")  # not_evicted, confirmed, R on device
WTSMALL_SECOND = sglang_json(LIVE + "probe_write_through_small_host_second.json")  # host pool 48,001
API_TARGETS = sglang_json(LIVE + "exporter_api_targets_3_rounds.json")


def record(verdict: str, *, cause: str = "none", rehost=(0, 14336, 0), confirmed: bool = True,
           host_used: float | None = None, hicache: bool = True) -> dict:
    """A real 0.5.17 `probe --json` record (write_through, second probe) with its outcome rewritten."""
    rec = copy.deepcopy(WT_SECOND)
    rec.update(verdict=verdict, cause=cause)
    rec["pressure"]["eviction_confirmed"] = confirmed
    rec["server"]["enable_hierarchical_cache"] = hicache
    for step in rec["steps"]:
        if step["phase"] == "rehost":
            step["cached"] = dict(zip(("device", "host", "storage"), rehost))
        if host_used is not None:
            for snap in (step["before"], step["after"]):
                snap["host_used_tokens"] = host_used
    if verdict == "hicache_disabled":
        rec.update(steps=[], tokens_canary=0, tokens_pressure=0)
    return rec


def judged(server: str, rec: dict) -> tuple[bool, str]:
    return rs.judge(rs.view_of(rec, "t"), rs.BY_NAME[server].expect)


# ------------------------------------------------------------------ the expectation table


def test_the_matrix_covers_every_configuration_the_issue_names_with_its_expected_verdict() -> None:
    flags = {s.name: " ".join(s.flags) for s in rs.SERVERS}
    expect = {s.name: s.expect for s in rs.SERVERS}
    by_policy = {p: [n for n, f in flags.items() if f.endswith(f"--hicache-write-policy {p}")]
                 for p in ("write_through", "write_back", "write_through_selective")}
    assert all(by_policy.values()), by_policy
    assert any("--page-size 64" in f for f in flags.values())
    assert any("--hicache-ratio 1.2" in f for f in flags.values())
    assert any(s.model == "dense" and "write_through" in flags[s.name] for s in rs.SERVERS)
    off = [n for n, f in flags.items() if "--enable-hierarchical-cache" not in f]
    assert len(off) == 1 and expect[off[0]].verdicts == ("hicache_disabled",)
    for name in by_policy["write_back"] + by_policy["write_through"]:
        if "--hicache-ratio 4" in flags[name] and "--page-size" not in flags[name]:
            assert expect[name].verdicts == ("reused",), name
    small = next(n for n, f in flags.items() if "--hicache-ratio 1.2" in f)
    assert set(expect[small].verdicts) == {"silent", "reused"} and expect[small].causes == ("host_pool_pressure",)
    # No expectation anywhere accepts the verdicts the issue rules out on an idle server.
    assert not any(v in e.verdicts for e in expect.values() for v in ("not_evicted", "inconclusive", "error"))


def test_target_names_read_as_strings_even_unquoted() -> None:
    for s in rs.SERVERS:
        assert yaml.safe_load(f"name: {s.name}")["name"] == s.name, f"{s.name} is not a plain YAML string"


# ------------------------------------------------------------------ judging real and rewritten records


def test_the_live_write_through_record_of_issue_11_is_a_fail_for_both_of_its_faults() -> None:
    ok, why = judged("wt", WT_SECOND)
    assert not ok
    assert "not_evicted on an idle server" in why
    assert "confirmed while R stayed on device" in why and "dev 14,336 / host 0 of 16,320" in why


@pytest.mark.parametrize(
    "server, rec, ok, why",
    [
        pytest.param("wt", record("reused"), True, "from host (88%)", id="reused-from-host"),
        pytest.param("wt", record("reused", rehost=(14336, 0, 0)), False, "confirmed while R stayed on device",
                     id="reused-but-rehost-hit-device"),
        pytest.param("wt", record("reused", rehost=(14336, 0, 0), confirmed=False), False, "reused while R stayed on device",
                     id="reused-on-device-unconfirmed"),
        pytest.param("wt", record("reused", rehost=(0, 2048, 0)), False, "only 13% of R came from host",
                     id="reused-with-a-small-host-share"),
        pytest.param("wt", record("silent", cause="unknown", rehost=(0, 0, 0)), False, "expected reused, got silent",
                     id="silent-where-reuse-expected"),
        pytest.param("wt", record("inconclusive", rehost=(0, 0, 0)), False, "got inconclusive", id="inconclusive"),
        pytest.param("wt", record("error"), False, "got error", id="error"),
        pytest.param("wt", {"verdict": None, "problem": "probe ran past 180 s"}, False, "ran past 180 s", id="timeout"),
        pytest.param("wtsmall", record("silent", cause="host_pool_pressure", rehost=(0, 6144, 0), host_used=157_000.0),
                     True, "host pool 98% full, 38% of R from host", id="small-host-silent-pool-full"),
        pytest.param("wtsmall", record("silent", cause="host_pool_pressure", rehost=(0, 6144, 0), host_used=40_000.0),
                     False, "only 25% full", id="small-host-silent-pool-not-full"),
        pytest.param("wtsmall", record("silent", cause="unknown", rehost=(0, 6144, 0), host_used=157_000.0), False,
                     "cause unknown, expected host_pool_pressure", id="small-host-silent-unknown-cause"),
        pytest.param("wtsmall", record("silent", cause="host_pool_pressure", rehost=(0, 14336, 0), host_used=157_000.0),
                     False, "silent although 88% of R came from host", id="small-host-silent-but-served"),
        pytest.param("wtsmall", record("reused"), True, "from host", id="small-host-reused"),
        pytest.param("nohicache", record("hicache_disabled", hicache=False), True, "nothing sent", id="off"),
        pytest.param("nohicache", record("reused"), False, "expected hicache_disabled", id="off-but-reused"),
    ],
)
def test_a_verdict_passes_only_when_expected_and_proven_by_its_tier_details(server, rec, ok, why) -> None:
    got_ok, got_why = judged(server, rec)
    assert (got_ok, why in got_why) == (ok, True), got_why


def test_exporter_rounds_are_judged_from_api_targets_with_the_host_pool_size_from_a_cli_record() -> None:
    targets = {t["config"]["name"]: t for t in API_TARGETS["targets"]}
    wb = [rs.view_of(h, f"round {i}") for i, h in enumerate(targets["wb"]["history"], 1)]
    assert rs.judge_server("wb", wb, 3).passed
    wt = [rs.view_of(h, f"round {i}") for i, h in enumerate(targets["wt"]["history"], 1)]
    res = rs.judge_server("wt", wt, 3)
    assert not res.passed and all("not_evicted" in why for _, why in res.judged)
    # /api/targets entries carry host_used_tokens_after only; the pool's size comes from a CLI record
    assert rs.host_total_of(WTSMALL_SECOND) == 48_001
    hist = rs.view_of(targets["wtsmall"]["history"][0], "r1", rs.host_total_of(WTSMALL_SECOND))
    assert hist.host_full == pytest.approx(46_336 / 48_001)
    assert rs.judge_server("wb", wb[:2], 3).problem == "2 probes of 3"


def test_cost_rows_price_the_manual_method_and_the_floor_for_the_same_r() -> None:
    views = [rs.view_of(record("reused"), f"p{i}") for i in range(3)]
    res = rs.judge_server("wt", views, 3)
    [row] = rs.cost_rows([res, rs.judge_server("nohicache", [rs.view_of(record("hicache_disabled"), "x")], 1)])
    assert row == ["wt", "3", "16,384", "40,000", "72,789", "212,992", "0.34", "89,152", "0.82"]


# ------------------------------------------------------------------ exporter config, dry run


def test_the_generated_exporter_config_passes_the_real_check_config(tmp_path) -> None:
    targets = [(s.name, 30001 + i) for i, s in enumerate(rs.SERVERS)]
    cfg = tmp_path / "c.yml"
    cfg.write_text(rs.exporter_config(targets, 19999, 20))
    p = subprocess.run(canary_argv("check-config", str(cfg)), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"{len(targets)} target(s)" in p.stdout and "listen 127.0.0.1:19999" in p.stdout
    doc = yaml.safe_load(cfg.read_text())
    assert doc["defaults"]["interval"] == "20s" and doc["max_concurrent_probes"] == len(targets)
    assert [(t["name"], t["url"]) for t in doc["targets"]] == [(n, f"http://127.0.0.1:{p}") for n, p in targets]


def test_dry_run_prints_every_launch_command_and_starts_nothing() -> None:
    p = subprocess.run([sys.executable, str(REPO / "bench" / "real_sglang.py"), "--dry-run", "--python", "/opt/sg/bin/python",
                        "--canary", "/tmp/hc/bin/hicache-canary", "--mem-fraction", "0.08"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for s in rs.SERVERS:
        line = next(l for l in p.stdout.splitlines() if l.startswith(f"  {s.name}: "))
        assert "/opt/sg/bin/python -m sglang.launch_server" in line and "--mem-fraction-static 0.08" in line
        assert line.endswith(" ".join(s.flags)) and f"tiny-{s.model}" in line
    assert "/tmp/hc/bin/hicache-canary probe --target URL --json" in p.stdout


# ------------------------------------------------------------------ report over real records, and orchestration


def bench(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "real_sglang.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def test_report_over_the_live_0517_records_fails_the_write_through_rows_and_archives_everything(tmp_path) -> None:
    out = tmp_path / "run"
    (out / "probes" / "wt").mkdir(parents=True)
    (out / "probes" / "wt" / "probe_01.json").write_text(json.dumps(WT_SECOND))
    (out / "exporter").mkdir()
    (out / "exporter" / "api_targets.json").write_text(json.dumps(API_TARGETS))
    (out / "exporter" / "metrics.txt").write_text(sglang_text(LIVE + "exporter_metrics_after_3_rounds.txt"))
    p = bench("--phase", "report", "--out", str(out), "--probes", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in p.stdout.splitlines() if line.startswith("| ")]
    per_probe = {(r[0], r[1]): r for r in cells if len(r) == 9 and r[7] in ("PASS", "FAIL")}
    per_server = {r[0]: r for r in cells if len(r) == 6}  # the last row of a name: the exporter summary
    assert per_probe[("wt", "1")][7] == "FAIL" and per_probe[("wt", "1")][8].startswith("not_evicted on an idle server")
    assert per_server["wb"][3:] == ["3/3", "PASS", ""] and per_server["wt"][3:5] == ["0/3", "FAIL"]
    assert "not in SERVERS" in per_server["off"][5]
    assert "RESULT: FAIL" in p.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and report["probes"][0]["probes"][0]["why"].startswith("not_evicted")
    with tarfile.open(tmp_path / "run.tgz") as tar:
        names = set(tar.getnames())
    assert {"run/probes/wt/probe_01.json", "run/exporter/api_targets.json", "run/report.txt", "run/report.json"} <= names


def ports_free(base: int, n: int) -> bool:
    for port in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def test_split_phases_start_probe_serve_and_stop_by_process_group_with_the_simulator_standing_in(tmp_path) -> None:
    """The plumbing only: the verdicts here are the simulator's, not SGLang's."""
    base = next(b for b in range(39100, 40000, 17) if ports_free(b, len(rs.SERVERS)))
    models = tmp_path / "models"
    for kind in ("hybrid", "dense"):  # present: the build (which needs torch) is skipped
        (models / f"tiny-{kind}").mkdir(parents=True)
        (models / f"tiny-{kind}" / "config.json").write_text("{}")
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests" / "sglang_shim"))
    common = ["--python", sys.executable, "--canary", shlex.join(canary_argv()), "--model-dir", str(models),
              "--out", str(tmp_path / "run"), "--only", "wb,nohicache", "--base-port", str(base),
              "--probes", "2", "--rounds", "1", "--interval", "5", "--health-timeout", "60"]
    start = bench("--phase", "start", *common, env=env)
    assert start.returncode == 0, start.stdout + start.stderr
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    pids = [s["pid"] for s in state["servers"].values()]
    assert sorted(state["servers"]) == ["nohicache", "wb"] and all(rs.alive(pid) for pid in pids)
    try:
        run = bench("--phase", "probe,serve", *common, env=env, timeout=240)
        assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    finally:
        rs.stop_groups(pids, grace_s=5)  # whatever happened above, nothing of ours outlives the test
    assert "RESULT: PASS" in run.stdout
    assert not any(rs.alive(pid) for pid in pids), "serve must stop the servers it found in state.json"
    with tarfile.open(tmp_path / "run.tgz") as tar:
        names = set(tar.getnames())
    for want in ("run/probes/wb/probe_02.json", "run/probes/nohicache/probe_01.json", "run/exporter/metrics.txt",
                 "run/exporter/api_targets.json", "run/servers/wb/metrics_after_probes.txt",
                 "run/servers/wb/log_tail.txt", "run/state.json", "run/report.txt"):
        assert want in names, f"{want} missing from the archive"
    assert not any(n.endswith("/server.log") for n in names)


def test_the_exported_verdict_is_read_from_the_exporters_real_metrics() -> None:
    exported = rs.exported_verdicts(sglang_text(LIVE + "exporter_metrics_after_3_rounds.txt"))
    assert exported == {"off": "hicache_disabled", "wb": "reused", "wt": "not_evicted", "wtsmall": "not_evicted"}
