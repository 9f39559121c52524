import sys

from hicache_canary.cli import main

sys.exit(main())
