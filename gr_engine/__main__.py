"""``python -m gr_engine``: the command line."""

import sys

from .cli import main

if __name__ == "__main__":  # not when a spawned worker (the benchmark's simulations) re-imports this module
    sys.exit(main())
