"""The rank processes: the supervisor that spawns and follows them, the worker each
runs, the model it builds, and the control channel between the server and them, on one
host or across nodes."""
