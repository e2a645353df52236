"""Pipelines from libraries, written on the public surface `lifecycle.pipelines` alone."""
