"""Artifacts: file manifests with checksums, listing, ranged downloads and tar archives."""
