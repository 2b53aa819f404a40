"""apex.parallel on torch.distributed: ``DistributedDataParallel``, ``Reducer``,
``SyncBatchNorm``, ``convert_syncbn_model``, ``create_syncbn_process_group``, ``ReduceOp``, and
``LARC`` in its own module, as apex had it (``from apex.parallel.LARC import LARC``).

- distributed.py: ``DistributedDataParallel`` and ``Reducer`` (flat.py: apex's flat collectives,
  ``flat_dist_call``; grad_allreduce.py: DDP's bucketed gradient all-reduce);
- sync_batchnorm.py: ``SyncBatchNorm`` and the model conversion (sync_batchnorm_kernel.py: its
  statistics and backward);
- LARC.py: ``LARC``.

CPU with gloo and CUDA with nccl; fp32, fp16 and bf16. ``apex.parallel`` resolves here through
apex_lite's apex alias and its ``apex`` distribution.
"""
import torch

from .distributed import DistributedDataParallel, Reducer, flat_dist_call
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group

# apex exported the reduce-op enum of the torch it ran on under this name.
ReduceOp = getattr(torch.distributed, "ReduceOp", None)

__all__ = ["DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group", "flat_dist_call", "ReduceOp"]
