"""The launcher: a startup run on this process or on spawned rank processes, and
`serve` under torchrun."""
