"""The verdict on a run: what its ranks' journals say happened, as facts (pure): read after
the fact by `replay`, and by the launcher and the server as their ranks end."""
