"""The command line: `lifecycle boot`, `serve`, `db`, `first-run`, their options and
config files."""
