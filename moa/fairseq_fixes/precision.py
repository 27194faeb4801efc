"""bfloat16 through fairseq's own flags, on CUDA and CPU, without torch_xla.

fairseq's ``options.parse_args_and_arch`` sets ``--tpu`` whenever ``--bf16`` (or
``--memory-efficient-bf16``) is given, so that ``fairseq-train --bf16`` asks for an XLA device and
fails (``'NoneType' object has no attribute 'xla_device'``) on every machine without torch_xla, and a
multi-GPU run tries to import torch_xla to spawn its ranks. :func:`call_main_without_xla` undoes that
inference before the run starts, where torch_xla cannot be imported: the run then trains on its GPU or
CPU with fairseq's own bf16 path (the model in bfloat16, fp32 master weights in fairseq's
``FP16Optimizer``, or none with ``--memory-efficient-bf16``). With torch_xla installed, fairseq's TPU
path is left as it is.

fairseq's inference CLIs (``fairseq-generate``, ``fairseq-interactive``, ``fairseq-eval-lm``) convert
the model for ``--fp16`` only and silently run in float32 under ``--bf16``.
:func:`prepare_for_inference_in_bf16` (fairseq's ``prepare_for_inference_``, which all three call)
also converts the model to bfloat16 under ``--bf16``; log-probabilities and beam scores stay float32,
as fairseq computes them.
"""

import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


def xla_available() -> bool:
    return importlib.util.find_spec("torch_xla") is not None


def without_xla(cfg):
    """``cfg`` (fairseq's config) with the ``tpu`` that ``--bf16`` implied cleared, unless torch_xla is
    there to serve it."""
    if cfg.common.tpu and cfg.common.bf16 and not xla_available():
        logger.info("--bf16 without torch_xla: bfloat16 on %s, not on a TPU (fairseq takes --bf16 to mean one)",
                    "the CPU" if cfg.common.cpu or not torch.cuda.is_available() else "the GPU")
        cfg.common.tpu = False
        if "tpu" in cfg.distributed_training:
            cfg.distributed_training.tpu = False
    return cfg


def call_main_without_xla(call_main):
    """fairseq's ``distributed.utils.call_main``, which first applies :func:`without_xla`."""

    def call_main_on_gpu_or_cpu(cfg, main, **kwargs):
        return call_main(without_xla(cfg), main, **kwargs)

    return call_main_on_gpu_or_cpu


def prepare_for_inference_in_bf16(prepare_for_inference_):
    """fairseq's ``BaseFairseqModel.prepare_for_inference_``, which also converts the model to bfloat16
    when ``cfg.common.bf16`` is set (fairseq's inference CLIs convert it for ``--fp16`` only)."""

    def prepare(self, cfg):
        prepare_for_inference_(self, cfg)
        if getattr(cfg.common, "bf16", False) and not getattr(cfg.common, "fp16", False):
            self.to(dtype=torch.bfloat16)
            logger.info("--bf16: %s runs in bfloat16", type(self).__name__)

    return prepare
