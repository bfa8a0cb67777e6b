"""The package version (a module of its own, so that modules can record it without importing the package's API)."""

__version__ = "0.1.0"
