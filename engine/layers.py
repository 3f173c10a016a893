"""The parallel modules that replace sharded ones. Plain tensors and explicit collectives, no DTensor.

Parameter names stay ``weight`` and ``bias`` so state-dict keys do not change; the tensors hold this
rank's slice (see `engine.plan` for which slice).
"""
from __future__ import annotations

import copy
import dis
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpmap.engine import rng
from tpmap.engine.collectives import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    sum_items_over_holders,
    sum_over_tp_region,
)


class _TPModule(nn.Module):
    """Base: holds the process group outside the module tree (a group cannot be deep-copied or saved)."""
    tp_group = None
    seq = None  # sequence parallelism's per-model state (engine.sequence), set on Columns and Rows in blocks
    dropout_watch = None  # rng.DropoutWatch of the model (engine.shard), for the compiled RNG region
    # A term added to this rank's local product before any collective: delta(x) -> (..., out_local), called
    # with the input as the matmul sees it (a Column's after copy_to_tp_region, a Row's split input). Set by
    # an adapter wrapper for the span of one call (tpmap.peft's LoRA), so a Row still all-reduces once.
    adapter_delta = None

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
    ``in_features`` / ``out_features`` are what this module reads and returns, as nn.Linear's (a model's
    forward may reshape by them): 8 and 3 here, or 8 and 6 with gather_output.
    """
    shared_copy = None  # collectives.SharedCopy of the Columns of one module (engine.shard), else None

    def __init__(self, weight, bias, *, reverse: bool, group, gather_order=None, gather_output=False,
                 copy_input=True, gathered_features: int | None = None, gather_width: int | None = None):
        super().__init__(group)
        self.weight, self.bias, self.reverse = weight, bias, reverse
        self.gather_output, self.copy_input = gather_output, copy_input
        assert gathered_features is not None or not gather_output, "gather_output needs the full output width"
        self.gathered_features = gathered_features  # the full output width, returned with gather_output
        self.gather_width = gather_width  # uneven split: every rank's output padded to the widest before gathering
        self.register_buffer("gather_order", gather_order, persistent=False)

    @property
    def in_features(self) -> int:  # the full input width
        return self.weight.shape[0 if self.reverse else 1]

    @property
    def out_features(self) -> int:  # this rank's output width, or the full one with gather_output
        return self.gathered_features if self.gather_output else self.weight.shape[1 if self.reverse else 0]

    def forward(self, x):  # (..., in) -> (..., out/tp_size), or (..., out) gathered
        if self.seq is not None and self.seq.active:  # x: this rank's tokens, or all, gathered upstream
            # y (..., T, out/tp_size) keeps only this rank's tokens for backward; x now the whole sequence it read
            y, x = self.seq.column_matmul(x, self)
        else:
            if self.copy_input:  # False: x already entered the TP region upstream (an Enter entry)
                x = (copy_to_tp_region(x, self.tp_group) if self.shared_copy is None
                     else self.shared_copy(x, self.tp_group))
            y = _matmul(x, self.weight, self.reverse)
        if self.adapter_delta is not None:  # on the input the product read: its gradient joins the same collective
            y = y + self.adapter_delta(x)  # (..., out/tp_size)
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output:
            if self.gather_width is not None and y.shape[-1] < self.gather_width:  # (..., out_r) -> (..., max out_r)
                y = F.pad(y, (0, self.gather_width - y.shape[-1]))
            return gather_from_tp_region(y, self.tp_group, self.gather_order)
        if self.training and not (self.seq is not None and self.seq.active):  # (SP: the block entered it)
            # what follows, up to the Row, is sharded: rank-specific dropout (engine.rng)
            rng.enter_sharded_region(dist.get_rank(self.tp_group), y.device, self.dropout_watch)
        return y

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, reverse={self.reverse}, gather_output={self.gather_output}"


class RowParallelLinear(_TPModule):
    """Y = XA + b with A split by input features: X_r (already split) times A_r, summed over ranks.

    The partial products are all-reduced (reduce_from_tp_region: identity backward) and the bias,
    replicated, is added once after the reduce.

    Example (2 ranks): an nn.Linear(6, 8) becomes weight (8, 3) per rank; X_r (B, T, 3) -> Y (B, T, 8).
    ``in_features`` / ``out_features`` are what this module reads and returns, as nn.Linear's: 3 and 8 here.
    """
    seq_closed = False  # sequence parallelism: this Row sits in a parent run on the whole sequence

    def __init__(self, weight, bias, *, reverse: bool, group):
        super().__init__(group)
        self.weight, self.bias, self.reverse = weight, bias, reverse

    @property
    def in_features(self) -> int:  # this rank's slice of the input width
        return self.weight.shape[0 if self.reverse else 1]

    @property
    def out_features(self) -> int:  # the full output width (the partial products are summed)
        return self.weight.shape[1 if self.reverse else 0]

    def forward(self, x):  # (..., in/tp_size) -> (..., out)
        if self.seq is not None and self.seq.active and self.seq_closed:  # inside a closed parent (engine.sequence)
            return self.seq.closed_row(self._partial(x), self.bias, self)
        if self.seq is not None and self.seq.active:  # (..., T, in/tp_size) -> (..., T/tp_size, out): reduce-scatter
            # the block, not the Row, leaves the dropout region: what follows holds this rank's tokens
            y = reduce_scatter_to_sequence_region(self.seq.row_partial(self._partial(x), self), self.tp_group, -2)
        else:
            try:
                partial = self._partial(x)
            finally:  # also when the product raises: activation checkpointing stops its replay early by
                # raising from the pack hook of the last tensor it needs, here when this Row saves it
                if self.training:
                    rng.leave_sharded_region(self.dropout_watch)
            y = reduce_from_tp_region(partial, self.tp_group, fresh=True)
        return y if self.bias is None else y + self.bias

    def _partial(self, x):  # (..., in/tp_size) -> (..., out): this rank's term of the sum
        partial = _matmul(x, self.weight, self.reverse)
        if self.adapter_delta is not None:
            partial = partial + self.adapter_delta(x)  # inside the sum: still one all-reduce (or reduce-scatter)
        return partial

    def extra_repr(self) -> str:
        return f"weight={tuple(self.weight.shape)}, reverse={self.reverse}"


class ColumnParallelEmbedding(_TPModule):
    """An nn.Embedding whose embedding_dim is split: rank r looks up columns E[:, r] (e.g. T5's
    relative_attention_bias (buckets, heads) -> (buckets, heads/tp_size)). Indices carry no gradient, so
    no collective is needed; the output stays split, like a Column's.
    """

    def __init__(self, weight, source: nn.Embedding, *, group):
        super().__init__(group)
        self.weight = weight
        self.padding_idx, self.max_norm = source.padding_idx, source.max_norm
        self.norm_type, self.scale_grad_by_freq, self.sparse = (source.norm_type, source.scale_grad_by_freq,
                                                               source.sparse)
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids):  # (...) -> (..., dim/tp_size)
        return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding split along the vocabulary (Megatron's VocabParallelEmbedding).

    Rank r holds rows [vocab_start, vocab_end) (zero-padded to the common local size). Ids outside
    the range look up nothing (a zero row); the all-reduce sums the one rank that had each id.
    E: (V, H) -> (V_pad/tp_size, H); ids (B, T) -> (B, T, H), replicated.

    It is a cooperative nn.Embedding: its ``forward`` *is* the lookup. A model's own nn.Embedding
    subclass (Gemma's and BART's scaled word embeddings multiply the lookup by ``embed_scale``) is
    replaced by ``VocabParallel<Name>``, a class built once per subclass with bases
    ``(Subclass, VocabParallelEmbedding)`` (`vocab_parallel_class`): the subclass's own ``forward``
    still runs, and its ``super().forward(ids)`` lands here, in the parallel lookup. Build one with
    `replacing`, which takes over the original module's state (buffers such as ``embed_scale``,
    attributes, hooks) with the weight swapped for the shard. `lookup_bypass` tells at plan time
    whether a subclass's forward really reaches the lookup through ``super().forward``.

    ``num_embeddings`` keeps the full vocabulary; ``padding_idx`` is local to the shard (None on the
    ranks that do not hold it), so code that indexes the weight by it stays in bounds.
    """
    tp_group = None  # set per instance, outside the module tree (a group cannot be deep-copied or saved)

    @classmethod
    def replacing(cls, source: nn.Embedding, weight: nn.Parameter, *, vocab_start: int, vocab_end: int,
                  group) -> VocabParallelEmbedding:
        """A vocab-parallel copy of `source` holding `weight` (rows [vocab_start, vocab_end)). Only reads
        `source`: its parameter, buffer and hook containers are copied, never changed."""
        if source.max_norm is not None:
            raise NotImplementedError("vocab-parallel nn.Embedding with max_norm (renormalises rows in place)")
        klass = vocab_parallel_class(type(source))
        new = klass.__new__(klass)  # no __init__: the new module is the old one's state with a sharded weight
        new.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, set)) else v for k, v in vars(source).items()})
        new.weight = weight
        new.__dict__["tp_group"] = group
        new.vocab_start, new.vocab_end = vocab_start, vocab_end
        pad = source.padding_idx
        new.padding_idx = pad - vocab_start if pad is not None and vocab_start <= pad < vocab_end else None
        new.full_padding_idx = pad  # in the full vocabulary (a whole adapter's lookup: tpmap.peft)
        return new

    def forward(self, ids):  # (B, T) -> (B, T, H)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self.padding_idx, None, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp_group, fresh=True)

    def extra_repr(self) -> str:
        return f"rows [{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings}, local={tuple(self.weight.shape)}"


_VOCAB_PARALLEL_CLASSES: dict[type, type] = {}


def vocab_parallel_class(original: type) -> type:
    """The vocab-parallel class that replaces an nn.Embedding of class `original` (cached per class):
    VocabParallelEmbedding itself for a plain nn.Embedding, else ``VocabParallel<Name>`` with bases
    ``(original, VocabParallelEmbedding)``, whose MRO puts the parallel lookup right under
    `original`'s own forward."""
    if original is nn.Embedding:
        return VocabParallelEmbedding
    if issubclass(original, VocabParallelEmbedding):  # already one (a copy of a split module)
        return original
    if original not in _VOCAB_PARALLEL_CLASSES:
        name = "VocabParallel" + original.__name__
        _VOCAB_PARALLEL_CLASSES[original] = type(name, (original, VocabParallelEmbedding),
                                                 {"__module__": __name__, "__qualname__": name})
    return _VOCAB_PARALLEL_CLASSES[original]


_ATTRIBUTE_LOADS = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"}


def _calls_super_forward(function) -> bool:
    """Whether the bytecode of `function` calls ``super().forward`` (or ``super(Cls, self).forward``):
    a load of the global ``super`` whose next attribute load is ``forward``."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return False
    after_super = False
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL" and ins.argval == "super":
            after_super = True
        elif after_super and ins.opname in _ATTRIBUTE_LOADS:
            if ins.argval == "forward":
                return True
            after_super = False
    return False


def lookup_bypass(cls: type) -> str | None:
    """For an nn.Embedding subclass: None when its forward reaches ``nn.Embedding.forward`` through
    ``super().forward``, so that `vocab_parallel_class` can slot the parallel lookup under it; else
    the qualified name of the first ``forward`` (in MRO order, above nn.Embedding) that does not.

    How: every class of the MRO before nn.Embedding that defines ``forward`` must call
    ``super().forward`` (zero-argument or explicit ``super(Cls, self)``), read from the function's
    bytecode (decorators are unwrapped; the source file is not needed, nothing is run, so it works on
    the meta device). A forward that looks its rows up itself (``F.embedding(ids, self.weight)``,
    ``self.weight[ids]``) or calls ``nn.Embedding.forward(self, ids)`` by name would bypass the
    parallel lookup and index the shard with full-vocabulary ids. Limits: the check proves that such
    a call exists, not that every path takes it, nor that the forward reads no other rows of
    ``self.weight`` (`tpmap verify` catches those numerically).
    """
    for klass in cls.__mro__:
        if klass is nn.Embedding or klass is VocabParallelEmbedding:
            return None
        forward = klass.__dict__.get("forward")
        if forward is not None and not _calls_super_forward(forward):
            return f"{klass.__module__}.{klass.__qualname__}.forward"
    return None


class VocabParallelLMHead(_TPModule):
    """The LM head split along the vocabulary: rank r computes logits for its rows, Z_r = H W_r^T + b_r.

    The logits are all-gathered and cut to the real vocabulary, so padded logits never reach outputs:
    (B, T, H) -> (B, T, V). With ``loss_parallel`` set, in training mode they stay split,
    (B, T, V_pad/tp_size), for `engine.loss.sharded_cross_entropy`, which masks the padding; in eval
    mode (generate, evaluation) they are gathered all the same.
    """

    def __init__(self, weight, bias, *, vocab_start: int, vocab_end: int, vocab_size: int, group):
        super().__init__(group)
        self.weight, self.bias = weight, bias
        self.vocab_start, self.vocab_end, self.vocab_size = vocab_start, vocab_end, vocab_size
        self.loss_parallel = False
        self.loss_calls = 0  # counted by the loss_parallel loss function (see tpmap.api)
        self.in_features, self.out_features = weight.shape[1], vocab_size

    def forward(self, x):  # (B, T, H) -> (B, T, V), or (B, T, V_pad/tp_size) local
        x = copy_to_tp_region(x, self.tp_group)
        logits = F.linear(x, self.weight, self.bias)
        if self.adapter_delta is not None:
            logits = logits + self.adapter_delta(x)  # (B, T, V_pad/tp_size)
        if self.loss_parallel and self.training:
            return logits
        return gather_from_tp_region(logits, self.tp_group)[..., : self.vocab_size]

    def local_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's (padded) shard of logits that may have been gathered: (..., V) -> (..., V_pad/tp_size)."""
        if logits.shape[-1] == self.weight.shape[0] and logits.shape[-1] != self.vocab_size:
            return logits
        local = logits[..., self.vocab_start : self.vocab_end]
        pad = self.weight.shape[0] - local.shape[-1]
        return F.pad(local, (0, pad)) if pad else local

    def extra_repr(self) -> str:
        return (f"rows [{self.vocab_start}, {self.vocab_end}) of {self.vocab_size}, local={tuple(self.weight.shape)}, "
                f"loss_parallel={self.loss_parallel}")


class ShardedNorm(_TPModule):
    """RMSNorm / LayerNorm over a feature dim split over the ranks, exact (the Norm entry).

    rms:   y = x / sqrt(sum_r sum(x_r^2) / F + eps) * w_r
    layer: mu = sum_r sum(x_r) / F;  y = (x - mu) / sqrt(sum_r sum((x_r - mu)^2) / F + eps) * w_r + b_r
    l2:    y = x / sqrt(sum_r sum(x_r^2) + eps) [* w_r]   (no mean: a projection onto the unit sphere)
    The sums go through sum_over_tp_region (all-reduce forward and backward). As transformers' norms,
    it computes in float32 and returns the input dtype. x_r (..., F/tp_size) -> y_r (..., F/tp_size).

    Example (2 ranks): OLMo2's q_norm over 12 heads x 8 becomes weight (48,) per rank, reading q_r (B, T, 48).
    Ranks may hold different widths (uneven splits): F is the full count. `copies` (uneven key/value heads held
    on several ranks or twice on one): how many times each local feature is held over all ranks, each term of
    the sums divided by it so that every feature counts once (and its copies' gradients sum to the full one).

    Per-group statistics (`group_size` G_s > 0, Mamba-2's gated norm): F is read as groups of G_s features and
    each group has its own statistic, divided by G_s. With `local_groups` every rank holds whole groups and
    computes them alone, as the unsharded module does (no collective); otherwise `groups` gives the group of
    each local feature, and the per-group sums (..., F/G_s) are all-reduced. `gate` ("silu"): forward(x, gate)
    normalizes x * silu(gate), gate (..., F/tp_size) split like x.
    """

    def __init__(self, weight, bias, *, statistic: str, eps: float, features: int, group, copies=None,
                 group_size: int = 0, groups=None, local_groups: bool = False, gate: str = ""):
        super().__init__(group)
        assert not (local_groups and (copies is not None or groups is not None)), "local groups are held once"
        self.weight, self.bias = weight, bias
        self.statistic, self.eps, self.features = statistic, eps, features
        self.group_size, self.local_groups, self.gate = group_size or features, local_groups, gate
        self.register_buffer("copies", copies, persistent=False)  # int64 (F_local,), or None: each held once
        self.register_buffer("groups", groups, persistent=False)  # int64 (F_local,), or None: one group/local

    def _sum(self, h):  # (..., F_local) -> the sums over the ranks, each feature once: (..., 1) or per feature
        if self.copies is not None:
            h = h / self.copies
        if self.groups is None:
            return sum_over_tp_region(h.sum(-1, keepdim=True), self.tp_group)
        sums = h.new_zeros(*h.shape[:-1], self.features // self.group_size).index_add(-1, self.groups, h)
        return sum_over_tp_region(sums, self.tp_group).index_select(-1, self.groups)  # (..., F_local)

    def _normalize(self, h):  # float32 (..., F_local)
        if self.local_groups:  # whole groups on this rank: the unsharded module's own math, per local group
            shape = h.shape
            h = h.view(*shape[:-1], -1, self.group_size)  # (..., F_local/G_s, G_s)
            if self.statistic == "layer":
                h = h - h.mean(-1, keepdim=True)
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).view(shape)
        if self.statistic == "layer":
            h = h - self._sum(h) / self.group_size
        squares = self._sum(h.pow(2))  # (..., 1) or (..., F_local)
        return h * torch.rsqrt((squares if self.statistic == "l2" else squares / self.group_size) + self.eps)

    def forward(self, x, gate=None):  # (..., F/tp_size) -> (..., F/tp_size)
        dtype = x.dtype
        h = x.to(torch.float32)
        if gate is not None:
            if not self.gate:
                raise TypeError("this norm was called with a gate, but its Norm entry declares none: add "
                                "`gate: silu` to the entry (the gate multiplies x before the statistic)")
            h = h * F.silu(gate.to(torch.float32))
        h = self._normalize(h)
        y = h if self.weight is None else self.weight * h
        if self.bias is not None:
            y = y + self.bias
        return y.to(dtype)

    def extra_repr(self) -> str:
        if self.weight is None:
            return f"{self.statistic}, no weight, eps={self.eps}"
        groups = "" if self.group_size == self.features else (
            f", groups of {self.group_size}" + (" (local)" if self.local_groups else ""))
        return (f"{self.statistic}, local={tuple(self.weight.shape)} of {self.features}{groups}, eps={self.eps}"
                + (f", gate={self.gate}" if self.gate else ""))


class RankModuleList(nn.ModuleList):
    """This rank's items of a ModuleList (a Param entry on a per-head list), under their original indices,
    so state-dict names stay those of the full model. Iterate it (zip, for); do not index it by position.

    `order` is the rank's local order with repeats (`ParamLayout.indices`): an item held twice (a key/value
    head read by two runs of this rank's query heads, uneven splits) is one module met twice when iterated,
    so autograd sums both uses into its one set of parameters."""

    def __init__(self, order: list[int], full: nn.ModuleList):
        super().__init__()
        for index in sorted(set(order)):
            self.add_module(str(index), full[index])
        self.tpmap_order = tuple(str(i) for i in order)
        self.tpmap_shared: tuple[int, object] | None = None  # (items in the full list, group): see share_over

    def share_over(self, count: int, group) -> None:
        """Some of these items are held by other ranks too: while autograd records, iterating yields each item
        called with its parameters passed through `sum_items_over_holders` (one all-reduce per list in backward),
        so each holder's gradient becomes the sum of every holder's."""
        self.tpmap_shared = (count, group)

    def __iter__(self):
        items = [self._modules[key] for key in self.tpmap_order]
        if self.tpmap_shared is None or not torch.is_grad_enabled():
            return iter(items)
        names, params, slots = [], [], []
        for key, module in self._modules.items():
            start = 0
            for name, p in module.named_parameters():
                if p.requires_grad:
                    names.append((key, name))
                    params.append(p)
                    slots.append((int(key), start))
                start += p.numel()
        if not params:
            return iter(items)
        count, group = self.tpmap_shared
        summed: dict[str, dict[str, torch.Tensor]] = {key: {} for key in self._modules}
        for (key, name), t in zip(names, sum_items_over_holders(params, slots, count, group)):
            summed[key][name] = t
        return iter([_Through(self._modules[key], summed[key]) for key in self.tpmap_order])

    def __len__(self) -> int:
        return len(self.tpmap_order)

    __repr__ = nn.Module.__repr__  # (ModuleList's own iterates)


class _Through:
    """Calls `module` with some of its parameters replaced by the given tensors (`torch.func.functional_call`)."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]):
        self.module, self.tensors = module, tensors

    def __call__(self, *args, **kwargs):
        return torch.func.functional_call(self.module, self.tensors, args, kwargs)


TP_MODULES = (ColumnParallelLinear, RowParallelLinear, ColumnParallelEmbedding, VocabParallelEmbedding,
              VocabParallelLMHead, ShardedNorm)
