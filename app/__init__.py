"""app package."""
