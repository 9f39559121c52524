"""Config of target discovery (Docker labels, a Prometheus server's targets, file_sd) and of sharding
the targets between exporter replicas."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from hicache_canary.settings.config_types import Duration, Port, Strict, Url


class DockerDiscoveryConfig(Strict):
    enabled: bool = False
    socket: str = "unix:///var/run/docker.sock"
    label: str = "hicache-canary.enable=true"
    url_label: str = "hicache-canary.url"
    name_label: str = "hicache-canary.name"
    port: Port = 30000
    refresh: Duration = 60.0


class PrometheusDiscoveryConfig(Strict):
    """Targets from a Prometheus server's own service discovery: its active targets of one job."""

    enabled: bool = False
    url: Url = "http://127.0.0.1:9090"
    job: str = Field(default="sglang", min_length=1)  # the `job` label of the targets, as in PromQL
    name_label: str = Field(default="instance", min_length=1)  # target label that names a canary target
    refresh: Duration = 60.0
    timeout: Duration = 10.0


class FileSDDiscoveryConfig(Strict):
    """Targets from Prometheus file_sd files (JSON or YAML target groups), re-read every `refresh`."""

    enabled: bool = False
    files: Annotated[list[str], Field(min_length=1)] = ["/etc/hicache-canary/targets/*.json"]
    name_label: str = Field(default="instance", min_length=1)
    scheme: Literal["http", "https"] = "http"  # unless a group sets the `__scheme__` label
    refresh: Duration = 30.0


class DiscoveryConfig(Strict):
    docker: DockerDiscoveryConfig = DockerDiscoveryConfig()
    prometheus: PrometheusDiscoveryConfig = PrometheusDiscoveryConfig()
    file_sd: FileSDDiscoveryConfig = FileSDDiscoveryConfig()


_SHARD_RE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True)
class Shard:
    """This replica's share of the targets: `index` of `count` (0-based), written `i/N`."""

    index: int = 0
    count: int = 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(value: Any) -> Shard:
    """`"1/4"` -> Shard(1, 4): replica 1 of 4, counted from 0."""
    m = _SHARD_RE.match(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{value!r} is not a shard (write i/N, e.g. 0/2: replica 0 of 2, counted from 0)")
    index, count = int(m.group(1)), int(m.group(2))
    if count < 1 or index >= count:
        raise ValueError(f"{value!r}: need 0 <= i < N (replicas are counted from 0)")
    return Shard(index, count)


ShardSpec = Annotated[Shard, BeforeValidator(lambda v: v if isinstance(v, Shard) else parse_shard(v))]
