"""Data the project generates itself (no third-party text)."""
