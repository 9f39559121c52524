"""Bad-config matrix (issue 7): every mistake exits 2 from `check-config` AND `serve`, with one line
naming the field, no traceback, and `serve` binds no port.

Every row runs both subcommands through `cli.main` in this process (the same code path as the
console script, without paying an interpreter start per row); a sample of rows, one per kind of
mistake, also runs both as real processes, with serve's port watched for as long as it lives.

tests/test_config.py already asserts the messages of unknown keys, bad URL schemes, URLs without a
host or with credentials, negative context, zero budget, bad durations, duplicate names, bad names,
no targets, a missing key file, key env + file, bad `api`, bad port, bad YAML, a top-level list and
bad URL/interval env overrides (through load_settings; the CLIs for two of them). The rows here are
the mistakes it does not cover (wrong types, other negative sizes, other URL and file problems,
more env overrides), each run through both real CLIs as a user would.
"""

from __future__ import annotations

import os
import socket
import sys
import subprocess
import time
from pathlib import Path

import pytest

from hicache_canary import cli
from procs import canary_argv, free_port

T = 'targets:\n  - {name: a, url: "http://127.0.0.1:1"%s}\n'


def target(extra: str = "") -> str:
    return T % (", " + extra if extra else "")


# id, config text (None: use `path` as is), env, expected stderr line ({dir} is the test's tmp dir)
ROWS = [
    ("type-context-string", target("context_tokens: lots"), {}, "targets[0].context_tokens: must be a valid integer"),
    ("type-context-fraction", target("context_tokens: 1.5"), {}, "targets[0].context_tokens: must be a valid integer"),
    ("type-targets-mapping", "targets: {name: a, url: 'http://127.0.0.1:1'}\n", {}, "targets: must be a valid list"),
    ("type-target-scalar", "targets: [http://127.0.0.1:1]\n", {}, "targets[0]: must be a valid dictionary or instance of TargetConfig"),
    ("type-url-number", "targets:\n  - {name: a, url: 5}\n", {}, "targets[0].url: must be a valid string"),
    ("type-interval-list", target("interval: [1]"), {}, "targets[0].interval: [1] is not a duration (use 30s, 10m, 1h or a number of seconds)"),
    ("type-api-bool", target("api: true"), {}, "targets[0].api: must be 'auto', 'native' or 'openai' (YAML reads an unquoted on, yes or true as the boolean true)"),
    ("negative-max-pressure", target("max_pressure_tokens: -5"), {}, "targets[0].max_pressure_tokens: must be greater than 0"),
    ("negative-chunk", target("pressure_chunk_tokens: 0"), {}, "targets[0].pressure_chunk_tokens: must be greater than 0"),
    ("negative-busy-threshold", "defaults: {busy_queue_threshold: -1}\n" + target(), {}, "defaults.busy_queue_threshold: must be greater than or equal to 0"),
    ("negative-dp-rank", target("dp_rank: -1"), {}, "targets[0].dp_rank: must be greater than or equal to 0"),
    ("zero-history-limit", "history_limit: 0\n" + target(), {}, "history_limit: must be greater than or equal to 1"),
    ("zero-concurrency", "max_concurrent_probes: 0\n" + target(), {}, "max_concurrent_probes: must be greater than or equal to 1"),
    ("ratio-above-one", target("host_hit_threshold: 1.5"), {}, "targets[0].host_hit_threshold: must be less than or equal to 1"),
    ("duration-zero", target("request_timeout: 0s"), {}, "targets[0].request_timeout: must be a positive duration"),
    ("duration-negative", target("poll_interval: -2"), {}, "targets[0].poll_interval: must be a positive duration"),
    ("url-port-out-of-range", 'targets:\n  - {name: a, url: "http://h:99999"}\n', {}, "targets[0].url: not a valid URL (Port out of range 0-65535)"),
    ("url-with-query", 'targets:\n  - {name: a, url: "http://h:1/?target=http://evil"}\n', {}, "targets[0].url: must not have a query or fragment"),
    ("url-bare-words", 'targets:\n  - {name: a, url: "not a url"}\n', {}, "targets[0].url: must start with http:// or https://"),
    ("no-targets-empty-file", "", {}, "targets: at least one target is required (or set HICACHE_CANARY_TARGET_URL, or enable discovery.docker, discovery.prometheus or discovery.file_sd)"),
    ("key-file-is-directory", target("api_key_file: {dir}"), {}, "targets[0].api_key_file: cannot read {dir}: Is a directory"),
    ("key-file-empty", target("api_key_file: {dir}/empty"), {}, "targets[0].api_key_file: {dir}/empty is empty"),
    ("token-file-empty", "probe_api_token_file: {dir}/empty\n" + target(), {}, "probe_api_token_file: {dir}/empty is empty"),
    ("key-env-unset-in-defaults", "defaults: {api_key_env: HICACHE_TEST_NO_SUCH_VAR}\n" + target(), {}, "defaults.api_key_env: environment variable HICACHE_TEST_NO_SUCH_VAR is not set"),
    ("env-context-negative", target(), {"HICACHE_CANARY_CONTEXT_TOKENS": "-5"}, "HICACHE_CANARY_CONTEXT_TOKENS: '-5' is not a positive whole number"),
    ("env-listen-port-zero", target(), {"HICACHE_CANARY_LISTEN_PORT": "0"}, "HICACHE_CANARY_LISTEN_PORT: '0' is not a port number"),
    ("config-missing", None, {}, "{dir}/missing.yml: cannot read config: No such file or directory"),
    ("config-is-directory", None, {}, "{dir}: cannot read config: Is a directory"),
]

# Found by this matrix as tracebacks (fixed in config.py since): the rows stay so they cannot return.
ROWS += [
    ("config-not-utf8", target() + "# caf\xe9\n", {}, "{dir}/config.yml: not UTF-8 text (byte 55); save the config as UTF-8"),
    ("key-file-not-utf8", target("api_key_file: {dir}/latin1"), {}, "targets[0].api_key_file: {dir}/latin1 is not UTF-8 text"),
    ("env-interval-defaults-list", "defaults: [1]\n" + target(), {"HICACHE_CANARY_INTERVAL": "30s"}, "defaults: must be a mapping, not list"),
    ("env-port-listen-scalar", "listen: 9807\n" + target(), {"HICACHE_CANARY_LISTEN_PORT": "9000"}, "listen: must be a mapping, not int"),
]


# Issue 14: what a careful attacker or a tired operator finds. Each row failed on the code before it
# (accepted, a traceback, a silently wrong value, or a confusing message).
YES = "(YAML reads an unquoted on, yes or true as the boolean true)"
NO = "(YAML reads an unquoted off, no or false as the boolean false)"
ROWS += [
    ("duration-nan", target("interval: .nan"), {}, "targets[0].interval: nan is not a finite duration (use 30s, 10m, 1h or a number of seconds)"),
    ("duration-inf", "defaults: {request_timeout: .inf}\n" + target(), {}, "defaults.request_timeout: inf is not a finite duration (use 30s, 10m, 1h or a number of seconds)"),
    ("duration-zero-allowed-but-nan", target("confirm_after: .NaN"), {}, "targets[0].confirm_after: nan is not a finite duration (use 30s, 10m, 1h or a number of seconds)"),
    ("ratio-nan", target("host_hit_threshold: .nan"), {}, "targets[0].host_hit_threshold: must be a finite number"),
    ("duplicate-targets-block", target() + "listen: {port: 9000}\ntargets:\n  - {name: b, url: 'http://127.0.0.1:2'}\n", {},
     "{dir}/config.yml: line 4: duplicate key 'targets' (first on line 1); give each key once"),
    ("duplicate-key-in-target", "targets:\n  - name: a\n    url: 'http://127.0.0.1:1'\n    name: b\n", {},
     "{dir}/config.yml: line 4: duplicate key 'name' (first on line 2); give each key once"),
    ("bool-context-yes", target("context_tokens: yes"), {}, f"targets[0].context_tokens: must be a valid integer {YES}"),
    ("bool-busy-no", target("busy_queue_threshold: no"), {}, f"targets[0].busy_queue_threshold: must be a valid integer {NO}"),
    ("bool-ratio-on", target("host_hit_threshold: on"), {}, f"targets[0].host_hit_threshold: must be a valid number {YES}"),
    ("bool-port-true", "listen: {port: true}\n" + target(), {}, f"listen.port: must be a valid integer {YES}"),
    ("bool-name-off", "targets:\n  - {name: off, url: 'http://127.0.0.1:1'}\n", {},
     "targets[0].name: must be a valid string (YAML reads an unquoted off, no or false as the boolean false: put the name in quotes)"),
    ("string-number-context", target("context_tokens: '16384'"), {}, "targets[0].context_tokens: must be a valid integer"),
    ("key-number-top-level", "1: x\n" + target(), {}, "1: unknown key (a number, not a name)"),
    ("key-bool-in-target", "targets:\n  - {name: a, url: 'http://127.0.0.1:1', on: 1}\n", {}, "targets[0].true: unknown key (a boolean, not a name)"),
    ("name-dot-dot", "targets:\n  - {name: '..', url: 'http://127.0.0.1:1'}\n", {},
     "targets[0].name: '..' is not a valid name (use 1-63 of a-z 0-9 _ . -, starting with a letter or digit)"),
    ("key-file-dev-zero", target("api_key_file: /dev/zero"), {}, "targets[0].api_key_file: /dev/zero is larger than 4 KiB (a secret file holds one key)"),
    ("token-file-too-large", "probe_api_token_file: {dir}/big\n" + target(), {}, "probe_api_token_file: {dir}/big is larger than 4 KiB (a secret file holds one key)"),
    ("config-dev-zero", None, {}, "/dev/zero is larger than 1 MiB; not a config file?"),
]


def _write_config(tmp: Path, row_id: str, text: str | None) -> Path:
    (tmp / "empty").write_text("")
    (tmp / "latin1").write_bytes(b"sk-caf\xe9")
    (tmp / "big").write_bytes(b"k" * 5000)
    if row_id == "config-missing":
        return tmp / "missing.yml"
    if row_id == "config-is-directory":
        return tmp
    if row_id == "config-dev-zero":
        return Path("/dev/zero")
    path = tmp / "config.yml"
    path.write_bytes(text.replace("{dir}", str(tmp)).encode("latin-1"))
    return path


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_CANARY_")}
    env.pop("HICACHE_TEST_NO_SUCH_VAR", None)
    return {**env, **extra}


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_both(config: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, bool]:
    """check-config and serve side by side; serve's port is watched for as long as it runs."""
    port = free_port()
    check = subprocess.Popen(canary_argv("check-config", str(config)), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    serve = subprocess.Popen(canary_argv("serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    bound = False
    deadline = time.monotonic() + 30
    while serve.poll() is None and time.monotonic() < deadline:
        bound = bound or _port_open(port)
        time.sleep(0.05)
    if serve.poll() is None:  # a config that was accepted: stop the exporter it started
        serve.terminate()
    out = [subprocess.CompletedProcess(p.args, p.wait(10), *p.communicate()) for p in (check, serve)]
    return out[0], out[1], bound or _port_open(port)


def run_in_process(config: Path, env: dict[str, str], monkeypatch, capsys) -> dict[str, tuple[int, str, str]]:
    for k in [k for k in os.environ if k.startswith("HICACHE_CANARY_")]:
        monkeypatch.delenv(k)
    monkeypatch.delenv("HICACHE_TEST_NO_SUCH_VAR", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = {}
    port = free_port()
    for argv in (["check-config", str(config)], ["serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]):
        monkeypatch.setattr(sys, "argv", ["hicache-canary", *argv])
        rc = cli.main(argv)
        captured = capsys.readouterr()
        out[argv[0]] = (rc, captured.out, captured.err)
    assert not _port_open(port)
    return out


@pytest.mark.parametrize("row_id,text,env,expected", ROWS, ids=[r[0] for r in ROWS])
def test_mistake_exits_2_with_one_line_from_both_commands(tmp_path: Path, monkeypatch, capsys, row_id: str, text: str | None,
                                                          env: dict, expected: str):
    config = _write_config(tmp_path, row_id, text)
    line = expected.replace("{dir}", str(tmp_path)) + "\n"
    out = run_in_process(config, env, monkeypatch, capsys)
    assert out["check-config"] == (2, "", line)
    assert out["serve"] == (2, "", line)


SAMPLE = ["type-targets-mapping", "negative-max-pressure", "duration-zero", "url-port-out-of-range", "key-file-is-directory",
          "env-listen-port-zero", "config-missing", "duration-nan", "duplicate-targets-block", "bool-context-yes", "key-file-dev-zero"]


@pytest.mark.parametrize("row_id,text,env,expected", [r for r in ROWS if r[0] in SAMPLE], ids=SAMPLE)
def test_mistake_as_real_processes_binds_nothing(tmp_path: Path, row_id: str, text: str | None, env: dict, expected: str):
    config = _write_config(tmp_path, row_id, text)
    check, serve, bound = run_both(config, _env(env))
    line = expected.replace("{dir}", str(tmp_path)) + "\n"
    assert (check.returncode, check.stdout, check.stderr) == (2, "", line)
    assert (serve.returncode, serve.stderr) == (2, line), serve.stderr[-2000:]
    assert "Uvicorn running" not in serve.stdout + serve.stderr
    assert not bound, "serve bound its port with a config it rejected"
