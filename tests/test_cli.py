import re
import subprocess

import pytest
from procs import canary_argv

SUBCOMMANDS = ("serve", "probe", "demo", "sim", "check-config")


def listed_subcommands(help_text: str) -> list[str]:
    """The names argparse lists under the COMMAND positional: one indented name per line, first word."""
    block = help_text.split("positional arguments:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^ {4}(\S+)", block, flags=re.M)


def test_help_lists_every_subcommand():
    out = subprocess.run(canary_argv("--help"), capture_output=True, text=True, check=True).stdout
    assert listed_subcommands(out) == list(SUBCOMMANDS)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_its_own_help(name):
    r = subprocess.run(canary_argv(name, "--help"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: hicache-canary {name} ")


def test_unknown_subcommand_exits_2_with_usage():
    r = subprocess.run(canary_argv("frobnicate"), capture_output=True, text=True)
    assert r.returncode == 2
    assert "invalid choice" in r.stderr and "Traceback" not in r.stderr
