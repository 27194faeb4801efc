"""What the plugin changes in fairseq 0.12 on this stack (torch 2.x, numpy 2, Python 3.11+), apart from
the method: the safe checkpoint loader's allow-list, damaged-checkpoint errors and crash-safe resumption,
data parallelism on CPU ranks and ``--bf16`` without torch_xla. :mod:`.patches` lists every change with
its reason; ``import moa`` applies them."""
