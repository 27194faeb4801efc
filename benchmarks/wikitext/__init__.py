"""WikiText-2: masked LMs and language models (see README.md)."""
