"""compose.yaml, exporter/Dockerfile and the deploy/ configs, checked without a Docker engine.

compose.yaml is validated against the compose spec's JSON schema (check-jsonschema's vendored copy),
then against what a user relies on: every mounted file exists in the repo, every dependency is a
service, every image is pinned, every published port binds to 127.0.0.1 unless BIND_ADDRESS says
otherwise, the exporter runs non-root on a read-only filesystem, Grafana has no default password, and
`--profile demo` brings a simulator whose command line the real simulator CLI accepts. The deploy
configs load with the exporter's real config loader; the Dockerfile's build context builds the package.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from procs import REPO

COMPOSE = REPO / "compose.yaml"
DOCKERFILE = REPO / "exporter" / "Dockerfile"
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::?([-?+])([^}]*))?\}")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's `${VAR:-default}` / `${VAR:?error}` interpolation, with env (default: nothing set)."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if env.get(name):
            return env[name]
        if op == "-":
            return arg
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return ""

    return _VAR.sub(sub, value)


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def test_compose_validates_against_the_compose_spec():
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    r = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_stack_has_the_services_and_the_demo_profile():
    svc = services()
    assert {"exporter", "prometheus", "alertmanager", "grafana"} <= set(svc)
    default = {n for n, s in svc.items() if not s.get("profiles")}
    assert default == {"exporter", "prometheus", "alertmanager", "grafana"}
    demo = {n for n, s in svc.items() if "demo" in s.get("profiles", [])}
    assert demo == {"simulator", "exporter-demo"}
    assert svc["exporter"]["build"] == {"context": ".", "dockerfile": "exporter/Dockerfile"}
    assert svc["exporter"]["command"] == ["serve", "--config", "/etc/hicache-canary/config.yml"]
    assert set(compose()["volumes"]) >= {"prometheus-data", "alertmanager-data", "grafana-data"}


def _bind_sources(svc: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            # Interpolate first: a `${VAR:-./default}` source contains a colon of its own.
            source, target = (interpolate(v).split(":") + [""])[:2]
        else:
            source, target = interpolate(v.get("source", "")), v.get("target")
        out.append((source, target))
    return out


def test_every_mounted_file_exists_in_the_repo():
    named = set(compose().get("volumes", {}))
    checked = 0
    for name, svc in services().items():
        for source, target in _bind_sources(svc):
            source = interpolate(source)
            if source in named:
                continue
            assert source.startswith("./"), f"{name}: {source} is neither a named volume nor a repo path"
            assert (REPO / source).exists(), f"{name} mounts {source} at {target}, which is not in the repo"
            checked += 1
    assert checked >= 9


def test_every_dependency_is_a_service():
    svc = services()
    for name, s in svc.items():
        deps = s.get("depends_on", {})
        for dep in deps if isinstance(deps, (list, dict)) else []:
            assert dep in svc, f"{name} depends on unknown service {dep}"
            # A default service may not wait on a demo-only one, or plain `up` would fail.
            if not s.get("profiles"):
                assert not svc[dep].get("profiles"), f"{name} depends on profile-only {dep}"


def test_every_image_is_pinned():
    for name, s in services().items():
        image = s.get("image")
        if image is None:
            assert "build" in s, name
            continue
        assert not image.endswith(":latest"), f"{name}: {image}"
        assert "@sha256:" in image or re.search(r":v?\d+\.\d+\.\d+", image), f"{name}: {image} is not pinned to a version"


def test_published_ports_bind_to_loopback_by_default():
    published = 0
    for name, s in services().items():
        for p in s.get("ports", []):
            assert isinstance(p, str), f"{name}: use the short HOST_IP:HOST:CONTAINER form"
            assert p.startswith("${BIND_ADDRESS:-127.0.0.1}:"), f"{name}: {p} does not bind to loopback by default"
            assert interpolate(p).startswith("127.0.0.1:")
            assert interpolate(p, {"BIND_ADDRESS": "10.1.2.3"}).startswith("10.1.2.3:")
            published += 1
    assert published >= 4
    assert "ports" not in services()["simulator"], "the demo simulator is for the compose network only"


def test_our_containers_run_non_root_read_only_without_capabilities():
    for name in ("exporter", "exporter-demo", "simulator"):
        s = services()[name]
        assert s["read_only"] is True, name
        uid = str(s["user"]).split(":")[0]
        assert uid.isdigit() and int(uid) != 0, name
        assert s["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in s["security_opt"], name
    for name, s in services().items():
        assert s.get("cap_drop") == ["ALL"] and "no-new-privileges:true" in s.get("security_opt", []), name
        assert not s.get("privileged") and s.get("network_mode") != "host", name
        assert not any("docker.sock" in src for src, _ in _bind_sources(s)), f"{name} mounts the Docker socket"


def test_grafana_has_no_default_credentials_and_anonymous_users_only_view():
    env = services()["grafana"]["environment"]
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD}"
    with pytest.raises(KeyError, match="GRAFANA_ADMIN_PASSWORD"):
        interpolate(env["GF_SECURITY_ADMIN_PASSWORD"])
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"


def test_exporter_reaches_sglang_on_this_node_by_default_and_from_env():
    s = services()["exporter"]
    url = s["environment"]["HICACHE_CANARY_TARGET_URL"]
    assert interpolate(url) == "http://host.docker.internal:30000"
    assert interpolate(url, {"SGLANG_URL": "http://10.0.0.5:30000"}) == "http://10.0.0.5:30000"
    assert "host.docker.internal:host-gateway" in s["extra_hosts"]
    assert "host.docker.internal:host-gateway" in services()["prometheus"]["extra_hosts"]
    # The exporter's default target name is the `target` label Prometheus puts on SGLang's series.
    prom = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())
    sglang_job = next(j for j in prom["scrape_configs"] if j["job_name"] == "sglang")
    labels = [sc.get("labels", {}).get("target") for sc in sglang_job.get("static_configs", [])]
    assert interpolate(s["environment"]["HICACHE_CANARY_TARGET_NAME"]) in labels


def test_prometheus_and_alertmanager_get_the_files_their_configs_name():
    prom = services()["prometheus"]
    mounts = dict(_bind_sources(prom))
    assert mounts["./prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    rules_dir = mounts["./prometheus/rules"]
    config = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())
    for pattern in config["rule_files"]:
        # rule_files are relative to the config file's directory, /etc/prometheus.
        assert str(Path("/etc/prometheus") / pattern).startswith(rules_dir + "/"), pattern
        assert list((REPO / "prometheus").glob(pattern)), pattern
    am = services()["alertmanager"]
    am_mounts = dict(_bind_sources(am))
    assert am_mounts["./prometheus/alertmanager.yml"] == "/etc/alertmanager/alertmanager.template.yml"
    assert am_mounts["./prometheus/render-alertmanager-config.sh"] == "/etc/alertmanager/render-alertmanager-config.sh"
    assert am_mounts["./deploy/alertmanager-secrets"] == "/etc/alertmanager/secrets"
    assert any("${ALERTMANAGER_SECRETS_DIR:-./deploy/alertmanager-secrets}:" in v for v in am["volumes"])
    script = " ".join(am["command"])
    assert "/etc/alertmanager/alertmanager.template.yml" in script and "--config.file=/alertmanager/alertmanager.yml" in script
    # Every secret name the Alertmanager config expects is documented where the user puts the files.
    wanted = set(re.findall(r"https://secret\.invalid/([A-Za-z0-9_.-]+)", (REPO / "prometheus/alertmanager.yml").read_text()))
    documented = (REPO / "deploy/alertmanager-secrets/README.md").read_text()
    assert wanted and all(f"`{w}`" in documented for w in wanted), wanted
    for target in ("alertmanager:9093", "exporter:9807"):
        assert target in (REPO / "prometheus" / "prometheus.yml").read_text()


def test_every_long_running_service_has_a_healthcheck():
    for name, s in services().items():
        test = s.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), name
        # Healthchecks run inside the container: they must ask the port the service listens on.
        joined = " ".join(test)
        assert re.search(r"127\.0\.0\.1:(\d+)", joined), name


# ---------------------------------------------------------------- the configs the containers mount


def test_deploy_configs_load_with_the_exporters_config_loader():
    from hicache_canary.settings.config import ConfigError, load_settings

    svc = services()
    env = {k: interpolate(str(v)) for k, v in svc["exporter"]["environment"].items()}
    settings = load_settings(REPO / "deploy/hicache-canary.yml", env)
    assert [(t.name, t.url) for t in settings.targets] == [("sglang", "http://host.docker.internal:30000")]
    assert settings.listen_port == 9807 and settings.probe_api_token is None  # endpoint closed by default
    with pytest.raises(ConfigError, match="at least one target"):
        load_settings(REPO / "deploy/hicache-canary.yml", {})  # no env, no target: refuses to start

    demo = load_settings(REPO / "deploy/hicache-canary.demo.yml", {})
    (target,) = demo.targets
    assert target.url == "http://simulator:30000" and target.interval_s <= 60
    assert dict(_bind_sources(svc["exporter-demo"]))["./deploy/hicache-canary.demo.yml"] == "/etc/hicache-canary/config.yml"
    assert dict(_bind_sources(svc["exporter"]))["./deploy/hicache-canary.yml"] == "/etc/hicache-canary/config.yml"


def test_demo_simulator_command_is_accepted_by_the_real_simulator_cli():
    from hicache_canary.simulator import cli as sim_cli

    command = services()["simulator"]["command"]
    assert command[0] == "sim"
    parser = argparse.ArgumentParser(prog="hicache-canary sim", exit_on_error=False)
    sim_cli.add_arguments(parser)
    args = parser.parse_args(command[1:])
    # The silent configuration of the field report, on the compose network.
    assert args.enable_hierarchical_cache and args.hybrid_model and args.enable_metrics
    assert args.hicache_write_policy == "write_through"
    assert args.hybrid_failure == "mamba_state_not_backed_up"
    assert args.host == "0.0.0.0" and args.port == 30000
    assert 0 < args.time_scale <= 0.1


# ---------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    lines, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.strip().startswith("#") and not buf:
            continue
        buf += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                lines.append((word.upper(), rest.strip()))
            buf = ""
    return lines


def test_dockerfile_pins_slim_python_runs_non_root_and_has_a_healthcheck():
    instrs = _dockerfile()
    froms = [rest for word, rest in instrs if word == "FROM"]
    assert froms and all(re.match(r"python:3\.11\.\d+-slim", f) for f in froms), froms
    users = [rest for word, rest in instrs if word == "USER"]
    assert users, "no USER"
    final_user = users[-1].split(":")[0]
    assert final_user not in ("root", "0"), final_user
    health = [rest for word, rest in instrs if word == "HEALTHCHECK"]
    assert health and "/healthz" in health[-1] and "python" in health[-1] and "curl" not in health[-1]
    entry = [rest for word, rest in instrs if word == "ENTRYPOINT"]
    assert entry == ['["hicache-canary"]']
    assert int(final_user) == int(str(services()["exporter"]["user"]).split(":")[0])


def _dockerignore_allows(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    import fnmatch

    allowed = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "*/")) for p in prefixes):
            allowed = neg
    return allowed


def test_the_build_context_the_dockerfile_sees_builds_the_package(tmp_path):
    """Copy exactly what .dockerignore lets through and the Dockerfile COPYs, then build the wheel."""
    ctx = tmp_path / "ctx"
    copies = [shlex.split(rest) for word, rest in _dockerfile() if word == "COPY" and "--from" not in rest]
    sources = [src for args in copies for src in args[:-1]]
    assert {"pyproject.toml", "README.md", "LICENSE", "exporter/"} <= set(sources)
    for src in sources:
        path = REPO / src
        assert path.exists() and _dockerignore_allows(src.rstrip("/")), src
        if path.is_dir():
            shutil.copytree(path, ctx / src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (ctx / src).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, ctx / src)
    assert not _dockerignore_allows("tests/test_compose.py") and not _dockerignore_allows(".venv")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                        str(tmp_path / "dist"), str(ctx)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("hicache_canary-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "hicache_canary/cli.py" in names and "hicache_canary/static/status.css" in names
    assert any(n.startswith("hicache_canary/simulator/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "hicache-canary = hicache_canary.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
