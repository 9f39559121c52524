import subprocess

from procs import canary_argv


def test_help_lists_every_subcommand():
    out = subprocess.run(canary_argv("--help"), capture_output=True, text=True, check=True).stdout
    for name in ("serve", "probe", "demo", "sim", "check-config"):
        assert name in out


def test_unknown_subcommand_exits_2_with_usage():
    r = subprocess.run(canary_argv("frobnicate"), capture_output=True, text=True)
    assert r.returncode == 2
    assert "invalid choice" in r.stderr and "Traceback" not in r.stderr
