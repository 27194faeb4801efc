"""fairseq's data-parallel training on CPU processes (gloo), launched by torchrun.

fairseq launches CPU ranks in no supported way: its own spawning starts one process per CUDA
device (none on a CPU machine, so ``--distributed-world-size 2 --cpu`` trains nothing and exits 0;
that is now an error that gives the torchrun command); under
torchrun it ignores the launch unless ``--distributed-world-size`` is given (its default is the
CUDA device count, so each CPU process trains alone, all writing to one save dir), and then
divides the rank by the CUDA device count (``ZeroDivisionError``); and its ``c10d`` backend hands
torch's ``DistributedDataParallel`` ``device_ids=[device_id]``, which torch refuses for a CPU
module. The replacements below (installed when the plugin is imported, before fairseq reads the
launch environment, by :mod:`moa.fairseq_fixes.patches`) fix them:

* under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) the world size is
  torchrun's, as fairseq itself does on GPUs; without CUDA each process is rank ``RANK`` on device 0;
* a CPU module gets ``device_ids=None`` and ``output_device=None``, as torch's DDP requires.

On any device, resuming a data-parallel run also needs the other ranks to unpickle the training
state rank 0 broadcasts; :func:`broadcast_with_state_globals` allows what that holds for the duration of the
broadcast only, so checkpoint files keep the narrow allow-list.

So ``torchrun --nproc-per-node 2 $(which fairseq-train) ... --cpu --distributed-backend gloo
--ddp-backend c10d`` (or ``legacy_ddp``) trains with two ranks. ``fully_sharded`` needs fairscale
(``pip install -e .[fsdp]``) and CUDA: fairscale's FSDP gathers parameters on CUDA streams, so on a
machine without CUDA asking for it is an error that names the CPU backends.
"""

import os

import torch

from moa.fairseq_fixes.checkpoint_safety import broadcast_state_globals

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def torchrun_aware_init_method(fairseq_infer_init_method):
    """fairseq's ``infer_init_method``, taking the world size from torchrun (which fairseq does
    only when ``--distributed-world-size`` is not 1, its CPU default) and, without CUDA devices,
    the rank from ``RANK`` on device 0; a CPU world size without torchrun is an error."""

    def infer_init_method(cfg, force_distributed=False):
        if getattr(cfg, "ddp_backend", None) == "fully_sharded" and not torch.cuda.is_available():
            raise ValueError("--ddp-backend fully_sharded needs CUDA GPUs: fairscale's FullyShardedDataParallel "
                             "gathers parameters on CUDA streams. On CPU, train data-parallel with --ddp-backend "
                             "c10d or legacy_ddp under torchrun")
        if cfg.distributed_init_method is None and all(name in os.environ for name in TORCHRUN_VARIABLES):
            cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
            if not torch.cuda.device_count() and cfg.distributed_world_size > 1:
                cfg.distributed_init_method = "env://"
                cfg.distributed_rank = int(os.environ["RANK"])
                cfg.device_id = 0
                cfg.distributed_no_spawn = True
                return
        spawning = (cfg.distributed_init_method is None and cfg.distributed_world_size > 1
                    and not cfg.distributed_no_spawn and not torch.cuda.device_count()
                    and not getattr(cfg, "tpu", False) and "SLURM_JOB_NODELIST" not in os.environ)
        if spawning:  # fairseq would spawn one process per CUDA device, none here, and train nothing
            n = cfg.distributed_world_size
            raise ValueError(f"--distributed-world-size {n} on a machine without CUDA devices: fairseq spawns one "
                             f"process per GPU, so it would train nothing. On CPU, launch one process per rank with "
                             f"torchrun: torchrun --standalone --nproc-per-node {n} $(which fairseq-train) ... --cpu "
                             f"--distributed-backend gloo (and leave out --distributed-world-size)")
        return fairseq_infer_init_method(cfg, force_distributed)

    return infer_init_method


class CPUAwareDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DDP, without the device ids fairseq passes when the module lives on the CPU."""

    def __init__(self, module, device_ids=None, output_device=None, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)


def broadcast_with_state_globals(fairseq_broadcast_object):
    """fairseq's ``broadcast_object`` with :func:`~moa.fairseq_fixes.checkpoint_safety.broadcast_state_globals`
    allowed to the safe unpickler while the object is received: how the other ranks get the
    training state rank 0 loaded when a data-parallel run resumes."""

    def broadcast_object(obj, src_rank, group, dist_device=None):
        with torch.serialization.safe_globals(broadcast_state_globals()):
            return fairseq_broadcast_object(obj, src_rank, group, dist_device)

    return broadcast_object
