"""Results: the row schema, the run store on disk, and the comparison of two runs."""

from attnbench.results.store import load_run, read_meta

__all__ = ["load_run", "read_meta"]
