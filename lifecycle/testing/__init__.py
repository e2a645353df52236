"""What an author of a plug-in pipeline or a store backend needs to test their own work, as
this project's tests use it:

- `lifecycle.testing.journals`: hand-built journals, written through the real journal API, for
  the runs no fault produces (`JournalBuilder`, with `a2a`, `done`, `beat`, `timeout_error`);
- `lifecycle.testing.plugins`: a minimal plug-in pipeline on `lifecycle.pipelines` alone
  (`PLUGIN`, which `--pipeline lifecycle.testing.plugins:PLUGIN` boots), and
  `check_plugin(plugin)`, which holds a plug-in to the protocol and runs one tiny request
  through it in the calling process;
- `lifecycle.testing.storecontract`: `StoreContract`, the contract every journal store backend
  keeps, as a pytest class a backend's tests subclass with a `location` fixture.

Nothing in `lifecycle` imports this package; pytest is imported only inside the contract's
tests, so every module here imports without it.
"""
