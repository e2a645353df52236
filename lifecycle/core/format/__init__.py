"""The journal's format (pure; shared with replay): the events and records a journal
holds, the states they name, their codec and upcasters, and the fold that rebuilds a
rank's view from them."""
