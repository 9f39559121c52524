"""Stand-in for `python -m sglang.launch_server` in tests: starts the project's simulator instead.

Only for tests/test_real_sglang_bench.py, which runs bench/real_sglang.py's orchestration (sessions,
/health wait, state file, probe loop, exporter, stop by process group, archive) on a CPU. It proves
nothing about SGLang itself: the verdicts come from the simulator. Flags the simulator does not
model (kernel backends, memory fraction, ...) are dropped; the model path says hybrid or dense.
"""

import argparse
import sys

from hicache_canary.simulator.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="sglang.launch_server (simulator stand-in)")
add_arguments(parser)
args, _dropped = parser.parse_known_args(sys.argv[1:])
args.hybrid_model = "hybrid" in (args.model_path or "")
args.metrics_profile = "0.5.17"
args.time_scale = 0.01
sys.exit(run(args))
