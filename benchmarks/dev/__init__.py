"""Developer tools: the speed guard, the GPU check, the device kit and its rehearsal (see README.md)."""
