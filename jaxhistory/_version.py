"""The package version (a leaf: modules that record it import it from here)."""

__version__ = "0.1.0"
