"""The edges: launcher, supervisor, rank worker, HTTP server and the command line."""
