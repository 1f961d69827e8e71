"""Custom ops of the GLM-5.2 model, one family per module; importing this package registers them.

``torch.ops.glm52.dsa_topk_indices``, ``sparse_mla`` / ``sparse_mla_bwd``, ``fp8_blockwise_mm``,
``grouped_mm`` / ``grouped_mm_bwd``, ``grouped_mm_pair`` / ``grouped_mm_pair_bwd``, ``grouped_mm_combine`` /
``grouped_mm_combine_bwd`` and their ``fp8_`` forms.
The reference kernels are PyTorch and run on any device;
``glm52_model.ops.cuda`` registers the TileLang CUDA kernels on the same ops (without TileLang: the
reference kernels, with a one-time warning per op).
"""
from . import dsa_topk, fp8, fp8_grouped_mm, grouped_mm, sparse_mla

__all__ = ["dsa_topk", "fp8", "fp8_grouped_mm", "grouped_mm", "sparse_mla"]

try:
    from . import cuda as _cuda  # noqa: F401  (TileLang CUDA kernels on the same ops)
except ImportError as e:  # only the "package not there" case is tolerated
    if e.name != f"{__name__}.cuda":
        raise
