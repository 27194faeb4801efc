"""Command-line tools installed as console scripts by setup.py."""
