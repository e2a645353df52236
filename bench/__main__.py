"""The `python -m bench` entry point."""

from __future__ import annotations

import sys

from bench.run import main

if __name__ == "__main__":
    sys.exit(main())
