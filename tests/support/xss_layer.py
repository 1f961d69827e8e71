"""A toy layer whose source line carries an HTML/script injection: dumps must show it as text and run nothing."""
import torch
import torch.nn as nn

from tests.support import toy  # noqa: F401  (registers sacpass_toy::topk_ids)

PAYLOAD = "</script><script>alert(1);document.documentElement.setAttribute('data-pwned','1')</script>"


class EvilIndexer(nn.Module):
    def __init__(self, dim=32, idx_dim=16):
        super().__init__()
        self.wq, self.wk = nn.Linear(dim, idx_dim, bias=False), nn.Linear(dim, idx_dim, bias=False)

    def forward(self, x):
        with torch.no_grad():
            q, k = self.wq(x), self.wk(x)
            return torch.ops.sacpass_toy.topk_ids(q, k, 4)  # </script><script>alert(1);document.documentElement.setAttribute('data-pwned','1')</script>


class EvilLayer(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.indexer = EvilIndexer(dim)
        self.wv = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        ids = self.indexer(x).long().clamp(min=0)
        return torch.utils.checkpoint.checkpoint(lambda v: self.wv(v)[ids].sum(1), x, use_reentrant=False)
