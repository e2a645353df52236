"""The host's weight keeper: the process that holds finished weights for the ranks."""
