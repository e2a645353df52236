"""The settings (pure): the server's configuration and its checks, model specs, and faults
on purpose."""
