"""`python -m lifecycle`: the same command as the `lifecycle` console script."""

from __future__ import annotations

import sys

from lifecycle.serve.cli import main

sys.exit(main())
