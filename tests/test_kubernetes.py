"""deploy/kubernetes/: both overlays rendered by the real `kubectl kustomize`, checked as a cluster would.

Every rendered object is validated against the vendored strict schemas (Kubernetes v1.30, Prometheus
Operator v0.93 CRDs; tests/testdata/kubernetes-schemas/README.md): an unknown or misspelled field
fails, as `kubectl apply --validate=strict` would. Then what a user relies on: the PrometheusRules
and dashboard ConfigMaps are exactly prometheus/rules/ and grafana/dashboards/, the canary runs
non-root on a read-only filesystem with no capabilities and bounded resources, the sidecar probes its
own pod on 127.0.0.1, the probe token is referenced from the Secret and never written into a
manifest, the monitors give the series the `job` and `target` labels the rules select on, and each
overlay's exporter config passes the exporter's own `check-config`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from procs import REPO, require_binary

K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = ["sidecar", "central"]
SCHEMAS = REPO / "tests" / "testdata" / "kubernetes-schemas"
SCHEMA_FILES = {
    ("v1", "ConfigMap"): "kubernetes-v1.30.0/configmap-v1.json",
    ("v1", "Secret"): "kubernetes-v1.30.0/secret-v1.json",
    ("v1", "Service"): "kubernetes-v1.30.0/service-v1.json",
    ("v1", "ServiceAccount"): "kubernetes-v1.30.0/serviceaccount-v1.json",
    ("apps/v1", "Deployment"): "kubernetes-v1.30.0/deployment-apps-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "prometheus-operator-v0.93.0/podmonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "prometheus-operator-v0.93.0/servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheus-operator-v0.93.0/prometheusrule-monitoring-v1.json",
}
CANARY = "hicache-canary"
GENERATOR = REPO / "scripts" / "generate-kubernetes-monitoring"


def kubectl() -> str:
    # The pinned wheel's binary (pyproject's test extra) before any other kubectl on PATH, so every
    # machine renders with the same kustomize.
    pinned = Path(sys.executable).with_name("kubectl")
    return str(pinned) if pinned.exists() else require_binary("kubectl")


@cache
def _render(overlay: str) -> str:
    r = subprocess.run([kubectl(), "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize {overlay} failed:\n{r.stderr}"
    return r.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(_render(overlay)) if d]


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name_prefix: str = "") -> dict[str, Any]:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix}*, got {[o['metadata']['name'] for o in found]}"
    return found[0]


@cache
def validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / SCHEMA_FILES[(api_version, kind)]).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(obj: dict[str, Any]) -> list[str]:
    key = (obj["apiVersion"], obj["kind"])
    assert key in SCHEMA_FILES, f"{key} has no vendored schema: add it (scripts/vendor-kubernetes-schemas)"
    errs = validator(*key).iter_errors(obj)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:200]}" for e in errs]


def canary_containers(objs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(Deployment, container) for every hicache-canary container rendered."""
    out = []
    for d in of_kind(objs, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["name"] == CANARY:
                out.append((d, c))
    return out


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def config_of(objs: list[dict[str, Any]], deployment: dict[str, Any]) -> str:
    """The exporter config file the canary container of `deployment` reads."""
    pod = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == CANARY]
    path = Path(container["args"][container["args"].index("--config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    cm = one(objs, "ConfigMap", volume["configMap"]["name"])
    return cm["data"][path.name]


def cpu(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def mem(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", q)
    assert m, f"unexpected memory quantity {q}"
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


def rule_files() -> list[Path]:
    return sorted((REPO / "prometheus" / "rules").glob("*.yml"))


# ---- rendering and schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_passes_the_strict_schemas(overlay):
    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Secret", "ConfigMap", "PodMonitor", "PrometheusRule"} <= kinds
    problems = {f"{o['kind']}/{o['metadata']['name']}": errs for o in objs if (errs := schema_errors(o))}
    assert not problems, json.dumps(problems, indent=1)


@pytest.mark.parametrize(
    "kind, mutate",
    [
        pytest.param("Deployment", lambda o: o["spec"]["template"]["spec"]["containers"][0].update(securityContex={}), id="misspelled-container-field"),
        pytest.param("Deployment", lambda o: o["spec"].update(replicas="2"), id="string-replicas"),
        pytest.param("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(relabelling=[]), id="misspelled-podmonitor-field"),
        pytest.param("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].pop("expr"), id="rule-without-expr"),
        pytest.param("Secret", lambda o: o["metadata"].update(labels={"a": 1}), id="non-string-label"),
    ],
)
def test_the_schemas_reject_what_a_cluster_would(kind, mutate):
    # The check above means something only if a wrong manifest fails it.
    obj = json.loads(json.dumps(of_kind(render("sidecar"), kind)[0]))
    assert not schema_errors(obj)
    mutate(obj)
    assert schema_errors(obj)


# ---- generated PrometheusRules and dashboards --------------------------------------------------


def test_the_generated_files_match_their_sources():
    r = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_drift_check_fails_when_a_rule_file_changes(tmp_path):
    for rel in ["scripts", "prometheus/rules", "grafana/dashboards", "deploy/kubernetes/base"]:
        shutil.copytree(REPO / rel, tmp_path / rel)
    rules = tmp_path / "prometheus" / "rules" / "hicache-canary.alerts.yml"
    rules.write_text(rules.read_text().replace("for: 5m", "for: 7m", 1))
    check = [sys.executable, str(tmp_path / "scripts" / GENERATOR.name), "--check"]
    r = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "deploy/kubernetes/base/prometheusrules.yaml is stale" in r.stderr
    assert "grafana-dashboards" not in r.stderr
    subprocess.run([sys.executable, str(tmp_path / "scripts" / GENERATOR.name)], check=True, capture_output=True, timeout=60)
    assert subprocess.run(check, capture_output=True, timeout=60).returncode == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_prometheusrules_are_the_rule_files(overlay):
    rendered = {o["metadata"]["name"]: o["spec"]["groups"] for o in of_kind(render(overlay), "PrometheusRule")}
    expected = {p.name.removesuffix(".yml").replace(".", "-"): yaml.safe_load(p.read_text())["groups"] for p in rule_files()}
    assert rendered == expected
    assert sum(len(g["rules"]) for gs in rendered.values() for g in gs) >= 20


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_dashboards_are_configmaps_for_grafanas_sidecar(overlay):
    cms = [c for c in of_kind(render(overlay), "ConfigMap") if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    rendered = {k: json.loads(v) for c in cms for k, v in c["data"].items()}
    expected = {p.name: json.loads(p.read_text()) for p in sorted((REPO / "grafana" / "dashboards").glob("*.json"))}
    assert rendered == expected
    # Client-side `kubectl apply` keeps a copy in an annotation capped at 256 KiB.
    assert all(len(json.dumps(c)) < 250_000 for c in cms)


# ---- the canary container ----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_canary_runs_non_root_read_only_without_capabilities(overlay):
    pairs = canary_containers(render(overlay))
    assert len(pairs) == 1
    deployment, c = pairs[0]
    pod_sc = deployment["spec"]["template"]["spec"].get("securityContext", {})
    sc = {**pod_sc, **c["securityContext"]}
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == 10001 and sc["runAsGroup"] == 10001  # exporter/Dockerfile's user
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"].get("privileged", False) is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # Read-only root: the only writable place is a small in-memory /tmp.
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    writable = [m for m in c["volumeMounts"] if not m.get("readOnly")]
    assert [m["mountPath"] for m in writable] == ["/tmp"]
    assert volumes[writable[0]["name"]]["emptyDir"]["sizeLimit"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_canary_has_requests_and_limits_above_its_measured_use(overlay):
    ((_, c),) = canary_containers(render(overlay))
    req, lim = c["resources"]["requests"], c["resources"]["limits"]
    assert set(req) == set(lim) == {"cpu", "memory"}
    assert 0 < cpu(req["cpu"]) <= cpu(lim["cpu"])
    assert 0 < mem(req["memory"]) <= mem(lim["memory"])
    # docs/benchmarks.md: RSS 62-63 MB with one target; the request covers it, the limit doubles it.
    assert mem(req["memory"]) >= 64 * 2**20 and mem(lim["memory"]) >= 2 * 64 * 2**20


def test_the_sidecar_probes_sglang_in_its_own_pod():
    objs = render("sidecar")
    ((deployment, c),) = canary_containers(objs)
    pod = deployment["spec"]["template"]["spec"]
    env = env_of(c)
    url = urlsplit(env["HICACHE_CANARY_TARGET_URL"]["value"])
    assert url.hostname == "127.0.0.1"
    sglang_ports = {p["containerPort"] for x in pod["containers"] if x["name"] != CANARY for p in x["ports"]}
    assert url.port in sglang_ports
    # Named after its pod, as base/podmonitor-sglang.yaml names SGLang's series: the rules join on it.
    assert env["HICACHE_CANARY_TARGET_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # A canary hiccup must never take the serving pod out of its Service.
    assert "readinessProbe" not in c
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_central_exporter_probes_workers_one_exporter_at_a_time():
    objs = render("central")
    ((deployment, _),) = canary_containers(objs)
    targets = yaml.safe_load(config_of(objs, deployment))["targets"]
    assert len(targets) >= 2
    assert all(urlsplit(t["url"]).hostname not in ("127.0.0.1", "localhost") for t in targets)
    # Two exporters on one target evict each other's R: no overlap during a rollout either.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_config_passes_the_exporters_own_check(overlay, tmp_path):
    objs = render(overlay)
    ((deployment, c),) = canary_containers(objs)
    config = tmp_path / "config.yml"
    config.write_text(config_of(objs, deployment))
    # The environment the pod gives it (downward API and Secret values filled in as the kubelet would).
    env = {"PATH": "/usr/bin:/bin", "HICACHE_CANARY_API_TOKEN": ""}
    for name, e in env_of(c).items():
        if "value" in e:
            env[name] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[name] = "sglang-5d8f7c9b4-x2x7q"
    r = subprocess.run([sys.executable, "-m", "hicache_canary", "check-config", str(config)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # Prometheus scrapes the pod IP: it must not listen on loopback only.
    assert "listen 0.0.0.0:9807" in r.stdout
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "canary")
    assert port == 9807
    if overlay == "sidecar":
        assert "1 target(s) (sglang-5d8f7c9b4-x2x7q)" in r.stdout


# ---- the probe token ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_probe_token_is_referenced_from_the_secret_not_inlined(overlay):
    objs = render(overlay)
    secret = one(objs, "Secret", "hicache-canary-probe-token")
    ((deployment, c),) = canary_containers(objs)
    ref = env_of(c)["HICACHE_CANARY_API_TOKEN"]
    assert "value" not in ref
    key_ref = ref["valueFrom"]["secretKeyRef"]
    assert key_ref["name"] == secret["metadata"]["name"]  # kustomize's hashed name: a new token rolls the pod
    assert key_ref["key"] in secret["data"]
    # Shipped empty: POST /api/probe stays closed until the user sets a token.
    assert secret["data"][key_ref["key"]] == ""
    # No literal secret anywhere in the pod or its config.
    for x in deployment["spec"]["template"]["spec"]["containers"]:
        for e in x.get("env", []):
            if re.search(r"TOKEN|KEY|PASSWORD|SECRET", e["name"]):
                assert "value" not in e, f"{x['name']}: {e['name']} is inlined"
    config = yaml.safe_load(config_of(objs, deployment))
    assert config["probe_api_token_env"] == "HICACHE_CANARY_API_TOKEN"
    assert "probe_api_token" not in config


# ---- monitors: the labels the rules select on --------------------------------------------------


def _selected_pods(objs: list[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    return [
        d["spec"]["template"]
        for d in of_kind(objs, "Deployment")
        if selector.items() <= d["spec"]["template"]["metadata"].get("labels", {}).items()
    ]


def _sets_label(endpoint: dict[str, Any], label: str) -> dict[str, Any]:
    (r,) = [r for r in endpoint.get("relabelings", []) if r.get("targetLabel") == label]
    return r


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_monitors_give_the_jobs_and_targets_the_rules_select_on(overlay):
    objs = render(overlay)
    rule_jobs = set(re.findall(r'job="([^"]+)"', "".join(p.read_text() for p in rule_files())))
    assert rule_jobs == {"hicache-canary", "sglang"}
    jobs: dict[str, dict[str, Any]] = {}
    for m in of_kind(objs, "PodMonitor") + of_kind(objs, "ServiceMonitor"):
        endpoints = m["spec"].get("podMetricsEndpoints") or m["spec"]["endpoints"]
        for ep in endpoints:
            jobs[_sets_label(ep, "job")["replacement"]] = {"monitor": m, "endpoint": ep}
    assert set(jobs) == rule_jobs
    # SGLang's own series get the pod name as `target`, the name the canary uses.
    sglang = jobs["sglang"]["endpoint"]
    assert _sets_label(sglang, "target")["sourceLabels"] == ["__meta_kubernetes_pod_name"]
    # The canary's scrape reaches a rendered port of the canary container.
    canary = jobs["hicache-canary"]
    port = canary["endpoint"]["port"]
    selector = canary["monitor"]["spec"]["selector"]["matchLabels"]
    if canary["monitor"]["kind"] == "PodMonitor":
        (pod,) = _selected_pods(objs, selector)
    else:
        (svc,) = [s for s in of_kind(objs, "Service") if selector.items() <= s["metadata"]["labels"].items()]
        assert port in {p["name"] for p in svc["spec"]["ports"]}
        (pod,) = _selected_pods(objs, svc["spec"]["selector"])
        port = next(p["targetPort"] for p in svc["spec"]["ports"] if p["name"] == port)
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == CANARY]
    assert port in {p["name"] for p in c["ports"]}
    if overlay == "sidecar":
        # The example SGLang pods are scraped too, on their named port.
        (sglang_pod,) = _selected_pods(objs, jobs["sglang"]["monitor"]["spec"]["selector"]["matchLabels"])
        ports = {p["name"] for x in sglang_pod["spec"]["containers"] for p in x.get("ports", [])}
        assert sglang["port"] in ports
