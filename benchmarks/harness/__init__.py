"""What every study shares, and the only code studies share (a study imports this, ``moa`` and ``moa_tools``,
never another study):

* :mod:`~benchmarks.harness.results`: paths, the shared data, provenance, writing results, Markdown tables;
* :mod:`~benchmarks.harness.timing`: timing with interleaved rounds and medians;
* :mod:`~benchmarks.harness.models`: models, batches, training steps and beam decoders built in-process;
* :mod:`~benchmarks.harness.fairseq_runs`: fairseq-train and fairseq-generate runs, their logs, MACs;
* :mod:`~benchmarks.harness.corpora`: the Multi30k and WikiText-2 preparations and their model recipes;
* :mod:`~benchmarks.harness.host_reads`: counting the operations that make a GPU's host wait, on a CPU.
"""
