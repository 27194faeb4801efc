"""The ``moa-*`` console scripts (setup.py's entry points): argument parsing around :mod:`moa_tools`."""
