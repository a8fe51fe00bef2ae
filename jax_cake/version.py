"""The package version (also in pyproject.toml), a leaf module so the native loader can read it without importing the package."""

__version__ = "0.1.0"
