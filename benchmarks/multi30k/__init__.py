"""Multi30k translation: equal training time, training to convergence, and their tables (see README.md)."""
