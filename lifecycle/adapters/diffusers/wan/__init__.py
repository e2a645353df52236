"""The Wan family (2.1, and 2.2's two experts): components driven one by one, Ulysses
attention, residency options, and the built-in `tiny-wan`."""
