"""A package, like nanochat's: its modules import each other absolutely (``from reachpkg.common import ...``)."""
