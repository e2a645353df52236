"""The rank's group: process groups and recorded collectives, the agreed abort, the
store's trust, the Flight Recorder, the heartbeat and signals."""
