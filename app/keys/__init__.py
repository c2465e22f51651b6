"""API keys: only sha256 hashes are stored; the key is shown once at creation."""
