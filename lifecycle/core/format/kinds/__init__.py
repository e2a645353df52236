"""The event kinds a journal holds, by family; lifecycle.core.format.events lists them all."""
