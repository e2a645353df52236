"""Finished weights outside the rank: a pipeline packed for the host's keeper, the keeper's
wire, and the startup's attach or load."""
