"""Upkeep of a journal: retention (prune), copies between journals, and the Flight
Recorder dumps kept with runs."""
