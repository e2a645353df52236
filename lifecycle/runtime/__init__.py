"""One rank at work: session, actions, recorded collectives, device, heartbeat, pipelines."""
