"""`python -m lifecycle`: the same command as the `lifecycle` console script."""

from __future__ import annotations

from lifecycle.serve.cli.main import entry

entry()
