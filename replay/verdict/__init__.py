"""The verdict as `replay` reads it: the facts are `lifecycle.verdict`'s, made here over a run
read from its journals, with what only the reader's host can tell, and told in sentences."""
