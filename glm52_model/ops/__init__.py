"""Custom ops of the GLM-5.2 model, one family per module; importing this package registers them.

``torch.ops.glm52.dsa_topk_indices``, ``sparse_mla`` / ``sparse_mla_bwd``, ``fp8_blockwise_mm``,
``grouped_mm`` / ``grouped_mm_bwd``. The reference kernels are PyTorch and run on any device;
``glm52_model.ops.cuda`` (when present and TileLang imports) registers CUDA kernels on the same ops.
"""
from . import dsa_topk, fp8, grouped_mm, sparse_mla
from .dsa_topk import dsa_topk_indices, topk_calls
from .fp8 import fp8_linear
from .grouped_mm import grouped_mm as grouped_mm_op
from .sparse_mla import sparse_mla as sparse_mla_op

__all__ = ["dsa_topk", "fp8", "grouped_mm", "sparse_mla", "dsa_topk_indices", "topk_calls", "fp8_linear",
           "grouped_mm_op", "sparse_mla_op"]

try:
    from . import cuda as _cuda  # noqa: F401  (TileLang CUDA kernels on the same ops)
except ImportError as e:  # only the "package not there" case is tolerated
    if e.name != f"{__name__}.cuda":
        raise
