"""The HTTP front of `lifecycle serve`: its endpoints, what they accept and reply, the
server's metrics, spans and failure."""
