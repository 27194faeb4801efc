"""The benchmarks, run from the repository root as modules: ``.venv/bin/python -m benchmarks.NAME`` (see README.md here)."""
