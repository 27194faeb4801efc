"""What every study shares, and the only code studies share (a study imports this, ``moa`` and ``moa_tools``,
never another study):

* :mod:`~benchmarks.harness.results`: paths, the shared data, provenance, writing results, Markdown tables;
* :mod:`~benchmarks.harness.timing`: timing with interleaved rounds and medians;
* :mod:`~benchmarks.harness.models`: models, batches, training steps and beam decoders built in-process;
* :mod:`~benchmarks.harness.fairseq_runs`: fairseq-train and fairseq-generate runs and their logs;
* :mod:`~benchmarks.harness.macs`: multiply-adds, counted on real models or written from the equations;
* :mod:`~benchmarks.harness.corpora`: the Multi30k and WikiText-2 preparations and their model recipes;
* :mod:`~benchmarks.harness.profiling`: a job under torch.profiler, by stage and by kind of operator;
* :mod:`~benchmarks.harness.host_reads`: counting the operations that make a GPU's host wait, on a CPU.
"""
