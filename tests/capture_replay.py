"""Replay a captured series of /metrics snapshots into a real Prometheus running the shipped rules.

`snapshots-every-10s.tgz` (tests/testdata/sglang/sglang-0.5.17-live/consecutive-probes/) holds
`snap/exporter_<unix time>.txt` and `snap/sglang_<port>_<unix time>.txt`: what a Prometheus next to
four live SGLang 0.5.17 servers and our exporter scraped, every 10 s. `start_replay()` turns every
snapshot into the samples that scrape stored (the `job`, `instance` and `target` labels
prometheus.yml gives them, and `up 1`), moves the whole capture in time so its last scrape lands
just before now, writes it as OpenMetrics with timestamps, builds TSDB blocks from it with
`promtool tsdb create-blocks-from openmetrics`, and starts Prometheus on those blocks with the
repository's prometheus.yml (rule files verbatim, no scrape targets, 1 s evaluation). Prometheus's
own rule manager then evaluates every recording rule and alert against the replayed data, as it
would have live.

Why this rather than serving the snapshots to a scraping Prometheus: it takes a second or two
instead of the capture's 200 s, and the samples keep their real 10 s spacing (rates come out as
they were), whatever the load on a 2-core machine.

Moving the capture in time also moves the exporter's values that are wall-clock times
(`*_timestamp_seconds`), so "time since the last probe" reads as it did when captured.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from fixtures import sglang_path
from procs import Proc, require_binary
from stack import start_prometheus
from test_prometheus_rules import PROM_DIR

CAPTURE_0517 = "sglang-0.5.17-live/consecutive-probes/snapshots-every-10s.tgz"
# consecutive-probes/README.md: the port of each server and its name in the exporter config.
TARGETS_0517 = {30001: "wt", 30002: "wb", 30003: "off", 30004: "wtsmall"}
EXPORTER_ADDR = "127.0.0.1:9807"

_SNAPSHOT = re.compile(r"(?:^|/)(exporter|sglang_(\d+))_(\d+)\.txt$")
_WALL_CLOCK = re.compile(r"(_timestamp_seconds|_created|^process_start_time_seconds)$")


@dataclass(frozen=True)
class Scrape:
    at: int  # unix seconds, from the snapshot's file name
    job: str
    instance: str
    target: str | None  # the static `target` label of the sglang job; None for the exporter
    text: str


def read_capture(tgz: Path, targets: dict[int, str]) -> list[Scrape]:
    """Every snapshot of the archive as the scrape it was, oldest first."""
    scrapes = []
    with tarfile.open(tgz) as tar:
        for member in tar.getmembers():
            m = _SNAPSHOT.search(member.name)
            if not member.isfile() or not m:
                continue
            text = tar.extractfile(member).read().decode()
            if m.group(1) == "exporter":
                scrapes.append(Scrape(int(m.group(3)), "hicache-canary", EXPORTER_ADDR, None, text))
            else:
                port = int(m.group(2))
                scrapes.append(Scrape(int(m.group(3)), "sglang", f"127.0.0.1:{port}", targets[port], text))
    if not scrapes:
        raise ValueError(f"{tgz}: no snap/<exporter|sglang_PORT>_<time>.txt inside")
    return sorted(scrapes, key=lambda s: (s.at, s.job, s.instance))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    return repr(float(value)).replace("inf", "Inf").replace("nan", "NaN")


def to_openmetrics(scrapes: list[Scrape], shift: int) -> str:
    """The samples Prometheus stored for these scrapes, `shift` seconds later, as OpenMetrics.

    No metadata lines: the backfill only needs samples, and each series' samples come out in time
    order because scrapes are written oldest first.
    """
    lines = []
    for s in scrapes:
        ts = s.at + shift
        scrape_labels = {"job": s.job, "instance": s.instance}
        if s.target is not None:
            scrape_labels["target"] = s.target
        lines.append(f"{_series('up', scrape_labels)} 1 {ts}")
        for family in text_string_to_metric_families(s.text):
            for sample in family.samples:
                # Prometheus keeps a scraped `target` (the exporter's) when the job sets none, and
                # would rename a clash to exported_target; prometheus.yml avoids clashes.
                labels = {**sample.labels, **scrape_labels}
                value = sample.value + shift if _WALL_CLOCK.search(sample.name) else sample.value
                lines.append(f"{_series(sample.name, labels)} {_number(value)} {ts}")
    return "\n".join(lines) + "\n# EOF\n"


def replay_config(out_dir: Path) -> Path:
    """The shipped prometheus.yml with its rule files verbatim, 1 s evaluation and nothing to scrape."""
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["rule_files"] = [str(PROM_DIR / pattern) for pattern in cfg["rule_files"]]
    cfg.pop("alerting", None)
    cfg["scrape_configs"] = []
    path = out_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@dataclass
class Replay:
    prom: Proc
    url: str
    start: float  # the replayed time of the first scrape
    end: float  # the replayed time of the last scrape
    work: Path  # the OpenMetrics file and the TSDB, removed by stop()
    targets: list[str] = field(default_factory=list)

    def stop(self) -> None:
        self.prom.stop()
        shutil.rmtree(self.work, ignore_errors=True)


def start_replay(capture: str = CAPTURE_0517, targets: dict[int, str] = TARGETS_0517, *, lag: int = 5) -> Replay:
    """Prometheus on the capture's samples, the last scrape `lag` seconds before Prometheus starts."""
    promtool = require_binary("promtool")
    scrapes = read_capture(sglang_path(capture), targets)
    work = Path(tempfile.mkdtemp(prefix="replay-"))
    shift = int(time.time()) - lag - scrapes[-1].at
    om = work / "capture.om"
    om.write_text(to_openmetrics(scrapes, shift))
    data = work / "data"
    made = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q", str(om), str(data)],
                          capture_output=True, text=True, timeout=120)
    if made.returncode != 0:
        raise RuntimeError(f"promtool could not build blocks from {om}:\n{made.stdout}{made.stderr}")
    prom, url = start_prometheus(replay_config(work), name="prometheus-replay", data_dir=data)
    return Replay(prom, url, scrapes[0].at + shift, scrapes[-1].at + shift, work, sorted(targets.values()))
