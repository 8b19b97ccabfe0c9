"""Runnable example jobs (not installed; run from the repository root)."""
