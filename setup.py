"""The packages the wheel holds, found rather than listed: every package under `lifecycle/` and
`replay/`, and the Alembic scripts of `migrations/`, which ship as `lifecycle.migrations` so that
an installed lifecycle migrates its journals (pyproject.toml holds everything else)."""

from setuptools import find_packages, setup

MIGRATIONS = "lifecycle.migrations"

setup(
    packages=[
        *find_packages(include=["lifecycle", "lifecycle.*", "replay", "replay.*"]),
        MIGRATIONS,
        *(f"{MIGRATIONS}.{name}" for name in find_packages("migrations")),
    ]
)
