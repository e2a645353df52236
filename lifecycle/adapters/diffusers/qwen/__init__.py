"""The Qwen-Image family: its spec, components driven one by one with true CFG, Ulysses
over the joint attention, and the built-in `tiny-qwen-image`."""
