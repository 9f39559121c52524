import sys
from pathlib import Path

# Tests import helpers as `procs`; the package itself is installed (scripts/test uses `pip install -e`).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "exporter"))
