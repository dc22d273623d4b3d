"""DeepSeek Sparse Attention (DSA) operators for glm5_next: k-pool lightning indexer with
streaming top-k, sparse MLA attention (absorbed / MQA form) forward and backward, and the
indexer's KL training loss. Triton kernels on CUDA, blockwise torch elsewhere; dense
definitions in :mod:`kernels.dsa.naive`.
"""

from kernels.dsa.errors import DSAInputError
from kernels.dsa.indexer import kpool_compress, lightning_indexer_topk
from kernels.dsa.loss import indexer_kl_loss
from kernels.dsa.naive import naive_sparse_mla_attention
from kernels.dsa.sparse_attention import sparse_mla_attention

__all__ = [
    "DSAInputError",
    "kpool_compress",
    "lightning_indexer_topk",
    "sparse_mla_attention",
    "naive_sparse_mla_attention",
    "indexer_kl_loss",
]
