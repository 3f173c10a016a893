"""The parallel modules that replace sharded ones. Plain tensors and explicit collectives, no DTensor.

Parameter names stay ``weight`` and ``bias`` so state-dict keys do not change; the tensors hold this
rank's slice (see `engine.plan` for which slice).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region


class _TPModule(nn.Module):
    """Base: holds the process group outside the module tree (a group cannot be deep-copied or saved)."""

    tp_group = None

    def __init__(self, group):
        super().__init__()
        self.__dict__["tp_group"] = group


def _matmul(x: torch.Tensor, weight: torch.Tensor, reverse: bool) -> torch.Tensor:
    return x @ weight if reverse else F.linear(x, weight)


class ColumnParallelLinear(_TPModule):
    """Y = XA + b with A split by output features: rank r computes Y_r = X A_r + b_r.

    X is replicated; it enters through copy_to_tp_region, so dX is all-reduced backward. With
    ``gather_output`` the shards of Y are all-gathered back into the full, original feature order.
    ``reverse``: the weight is stored [in, out_r] (transformers' Conv1D) instead of [out_r, in].

    Example (2 ranks): an nn.Linear(8, 6) becomes weight (3, 8) per rank; X (B, T, 8) -> Y_r (B, T, 3).
    """

    def __init__(self, weight, bias, *, reverse: bool, group, gather_order=None, gather_output=False):
        super().__init__(group)
        self.weight, self.bias, self.reverse = weight, bias, reverse
        self.gather_output = gather_output
        self.register_buffer("gather_order", gather_order, persistent=False)

    def forward(self, x):  # (..., in) -> (..., out/ws), or (..., out) gathered
        x = copy_to_tp_region(x, self.tp_group)
        y = _matmul(x, self.weight, self.reverse)
        if self.bias is not None:
            y = y + self.bias
        return gather_from_tp_region(y, self.tp_group, self.gather_order) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, reverse={self.reverse}, gather_output={self.gather_output}"


class RowParallelLinear(_TPModule):
    """Y = XA + b with A split by input features: X_r (already split) times A_r, summed over ranks.

    The partial products are all-reduced (reduce_from_tp_region: identity backward) and the bias,
    replicated, is added once after the reduce.

    Example (2 ranks): an nn.Linear(6, 8) becomes weight (8, 3) per rank; X_r (B, T, 3) -> Y (B, T, 8).
    """

    def __init__(self, weight, bias, *, reverse: bool, group):
        super().__init__(group)
        self.weight, self.bias, self.reverse = weight, bias, reverse

    def forward(self, x):  # (..., in/ws) -> (..., out)
        y = reduce_from_tp_region(_matmul(x, self.weight, self.reverse), self.tp_group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, reverse={self.reverse}"


class ColumnParallelEmbedding(_TPModule):
    """An nn.Embedding whose embedding_dim is split: rank r looks up columns E[:, r] (e.g. T5's
    relative_attention_bias (buckets, heads) -> (buckets, heads/ws)). Indices carry no gradient, so
    no collective is needed; the output stays split, like a Column's.
    """

    def __init__(self, weight, source: nn.Embedding, *, group):
        super().__init__(group)
        self.weight = weight
        self.padding_idx, self.max_norm = source.padding_idx, source.max_norm
        self.norm_type, self.scale_grad_by_freq, self.sparse = source.norm_type, source.scale_grad_by_freq, source.sparse
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids):  # (...) -> (..., dim/ws)
        return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


TP_MODULES = (ColumnParallelLinear, RowParallelLinear, ColumnParallelEmbedding)
