"""PyTorch Flight Recorder dumps: read, joined with the journal, shown."""
