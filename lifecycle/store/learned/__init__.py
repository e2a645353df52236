"""What the journal has learned per fingerprint for the next startup: the history of
states, verified residency plans, the traffic served and the compile artifacts."""
