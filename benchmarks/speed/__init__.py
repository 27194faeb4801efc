"""Speed and memory: modules and whole models, bfloat16, long-context decoding, torch.compile (see README.md)."""
