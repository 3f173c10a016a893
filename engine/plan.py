"""The plan: pure data saying what every rank holds and does. No tensor is read or written here.

The plan says, for every rank, which pieces of every sharded parameter it holds, which modules get
which parallel behaviour, and which attributes change to which per-rank values. `engine.planner`
builds it and checks everything while doing so (patterns match, parameters are claimed once, sizes
divide, attributes exist); executing it (`engine.shard`) then cannot fail on user input. The same
pieces drive slicing a full tensor, loading a rank's slice from a checkpoint, and gathering shards
back into a full tensor.

Pieces: ``pieces[r]`` is a tuple of ``(start, length)`` ranges along ``dim`` of the full tensor; the
rank's local tensor is their concatenation, in order. A fused [q|k|v] weight at tp_size 2 with 4
heads of 8 gives rank 1 ``((16, 16), (48, 16), (80, 16))`` = [q_1 | k_1 | v_1].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tpmap.engine.errors import UnevenSplitError
from tpmap.engine.pieces import Pieces
from tpmap.language import expr

# The closed sets of strings a plan holds.
ModuleStyle = Literal["column", "row", "norm", "vocab_embedding", "vocab_head"]
Holder = Literal["parameter", "buffer", "modules"]  # what a split tensor is on its module (Param entries)
Statistic = Literal["", "rms", "layer", "l2"]  # a Norm's statistic ("" for other styles)


@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """How one parameter is spread over the ranks."""
    name: str  # full name in the model, e.g. transformer.h.0.attn.c_attn.weight
    full_shape: tuple[int, ...]
    dim: int | None  # the split dim; None: every rank holds the whole tensor
    pieces: tuple[Pieces, ...] = ()  # per rank, ranges along dim
    replicated_heads: bool = False  # some ranges are held by more than one rank (KV heads < tp_size)
    local_size: int | None = None  # padded length along dim on every rank (uneven vocabularies), else None
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights), re-pointed to the shard
    partial: bool = False  # a term of a partial sum: rank 0 holds the tensor, the others zeros (Param partial)
    holder: Holder = "parameter"  # "modules": a ModuleList cut by Param

    def local_shape(self, rank: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.local_size or sum(n for _, n in self.pieces[rank])
        return tuple(shape)

    def indices(self, rank: int) -> list[int]:
        """Full-tensor indices along dim held by `rank`, in local order."""
        return [i for start, n in self.pieces[rank] for i in range(start, start + n)]


@dataclass(frozen=True, kw_only=True)
class ModuleShard:
    """A module replaced by its parallel counterpart."""
    name: str  # full module name
    style: ModuleStyle
    module_class: str
    reverse: bool
    gather_output: bool
    entry: int  # index of the mapping entry (for messages); -1 for vocab_parallel
    weight: ParamLayout | None  # None only for a Norm without a weight (statistic l2)
    bias: ParamLayout | None
    copy_input: bool = True  # Column: all-reduce the input's gradient (False after an Enter)
    statistic: Statistic = ""  # Norm: the statistic it computes
    eps: float = 0.0  # Norm: the module's epsilon
    group_size: int = 0  # Norm: features per statistic group (0: one statistic over the whole dim)
    gate: str = ""  # Norm: "silu" when the module takes x * silu(gate) before the statistic


@dataclass(frozen=True, kw_only=True)
class AttributeUpdate:
    module: str  # full module name
    attribute: str  # dotted path on the module; through `config` when via_config
    full_value: Any
    values: tuple[int, ...]  # per rank
    via_config: bool
    entry: int


@dataclass(frozen=True, kw_only=True)
class InputSlice:
    """A forward argument of a module sliced by heads before the module runs (Input entry)."""
    module: str  # full module name
    argument: str
    position: int  # index of the argument in forward's signature (for positional calls)
    dim: int
    heads: int  # heads along dim in the full tensor
    head_index: tuple[tuple[int, ...], ...]  # per rank: the heads it keeps
    flattened: bool  # dim holds batch x heads (batch-major)
    entry: int


@dataclass(frozen=True, kw_only=True)
class RouteSlice:
    """A module's routing arguments rewritten to this rank's experts before it runs (Route entry)."""
    module: str  # full module name
    index: str  # the argument of expert ids
    index_position: int  # its index in forward's signature (for positional calls)
    weights: str | None  # the argument of routing weights, or None
    weights_position: int
    experts: int  # experts in the full model
    held: tuple[tuple[int, int], ...]  # per rank: (first expert, count), a contiguous block
    entry: int


@dataclass(frozen=True, kw_only=True)
class Plan:
    model_type: str
    tp_size: int
    base_prefix: str  # "transformer." etc.: patterns are relative to this
    modules: tuple[ModuleShard, ...]
    updates: tuple[AttributeUpdate, ...]
    source: str = ""  # mapping file
    grad_allreduce: tuple[str, ...] = ()  # replicated parameters whose gradients are summed over ranks
    tensors: tuple[ParamLayout, ...] = ()  # bare tensors split in place (Param entries)
    reduces: tuple[str, ...] = ()  # modules whose output is all-reduced (Reduce entries)
    inputs: tuple[InputSlice, ...] = ()  # forward arguments sliced by heads (Input entries)
    routes: tuple[RouteSlice, ...] = ()  # routing arguments rewritten to each rank's experts (Route entries)
    enters: tuple[str, ...] = ()  # modules whose output's gradient is all-reduced (Enter entries)
    kept_whole: tuple[tuple[str, str, int], ...] = ()  # (pattern, reason, modules matched): a partial mapping
    refuse_sequence_parallel: str = ""  # the mapping's reason why sequence parallelism cannot run the model
    uneven: tuple[str, ...] = ()  # modules / tensors split unevenly (engine.pieces): ranks hold different counts
    even_world_sizes: tuple[int, ...] = ()  # when uneven: the world sizes up to 16 that split every layout evenly
    heads: tuple[int, ...] = ()  # the (query) head counts the layouts split, largest first (for `rank_heads`)

    def rank_heads(self) -> tuple[int, ...]:
        """Query heads per rank of the largest head count (() when no layout splits heads): 9 at 2 -> (5, 4)."""
        if not self.heads:
            return ()
        counts = [expr.rank_heads(self.heads[0], self.tp_size, r) for r in range(self.tp_size)]
        return tuple(len(c) if c is not None else 0 for c in counts)

    def rank_shares(self, full_params: dict[str, int]) -> tuple[float, ...]:
        """Per rank: the elements it holds / the model's, from {parameter name: numel} of the full model (every
        parameter once; split ones by their pieces or padded length, the others whole)."""
        layouts = self.params
        total = sum(full_params.values())
        out = []
        for r in range(self.tp_size):
            held = 0
            for name, numel in full_params.items():
                p = layouts.get(name)
                if p is None or p.dim is None:
                    held += numel
                else:  # an uneven vocabulary's rows padded to local_size are held too
                    held += numel // p.full_shape[p.dim] * (p.local_size or sum(n for _, n in p.pieces[r]))
            out.append(held / total if total else 1.0)
        return tuple(out)

    def refuse_uneven(self, path: str) -> None:
        """Raise UnevenSplitError when this plan splits unevenly: `path` (sequence parallelism, LoRA, ...) is not
        proven on uneven splits."""
        if self.uneven:
            raise UnevenSplitError(
                f"{path} is not supported at a world size that splits heads or features unevenly, and world size "
                f"{self.tp_size} splits {self.uneven[0]}" + (f" (and {len(self.uneven) - 1} more)" if
                                                             len(self.uneven) > 1 else "")
                + f" unevenly; world sizes that split this model evenly: "
                f"{', '.join(map(str, self.even_world_sizes)) or 'none up to 16'}")

    @property
    def params(self) -> dict[str, ParamLayout]:
        """Every split tensor by full name: module weights/biases and Param tensors (not ModuleLists)."""
        out = {}
        for m in self.modules:
            if m.weight is not None:
                out[m.weight.name] = m.weight
            if m.bias is not None:
                out[m.bias.name] = m.bias
        for t in self.tensors:
            if t.holder != "modules":
                out[t.name] = t
        return out

    def table(self, rank: int | None = None) -> str:
        """A plain-text table of the plan (all ranks' pieces when rank is None)."""
        rows = [("parameter", "style", "full shape", "dim", "local shape", "pieces (start:len) per rank")]
        for m in self.modules:
            for p in (m.weight, m.bias):
                if p is None:
                    continue
                style = m.style + ("+gather" if m.gather_output else "") + (" rev" if m.reverse else "") + (
                    f" {m.statistic}" if m.statistic else "") + (f" per {m.group_size}" if m.group_size else "") + (
                    f" gate={m.gate}" if m.gate else "")
                if p.dim is None:
                    rows.append((p.name, style, _shape(p.full_shape), "-", _shape(p.full_shape), "replicated"))
                    continue
                ranks = range(self.tp_size) if rank is None else [rank]
                pieces = " | ".join(
                    f"r{r}:" + ",".join(f"{s}:{n}" for s, n in p.pieces[r]) for r in ranks
                )
                if p.local_size:
                    pieces += f" (padded to {p.local_size})"
                rows.append((p.name, style, _shape(p.full_shape), str(p.dim), _local(p, ranks), pieces))
        for u in self.updates:
            vals = sorted(set(u.values))
            rows.append((f"{u.module}.{u.attribute}", "update", str(u.full_value), "-",
                         ",".join(map(str, vals)), "per-config-copy" if u.via_config else ""))
        for t in self.tensors:
            ranks = range(self.tp_size) if rank is None else [rank]
            if t.partial:
                rows.append((t.name, "param partial", _shape(t.full_shape), "-", _shape(t.full_shape),
                             "rank 0; zeros elsewhere"))
                continue
            pieces = " | ".join(f"r{r}:" + ",".join(f"{s}:{n}" for s, n in t.pieces[r]) for r in ranks)
            rows.append((t.name, f"param {t.holder}", _shape(t.full_shape), str(t.dim), _local(t, ranks), pieces))
        for name in self.reduces:
            rows.append((name, "reduce", "", "-", "", "output all-reduced"))
        for name in self.enters:
            rows.append((name, "enter", "", "-", "", "output gradient all-reduced"))
        for i in self.inputs:
            heads = " | ".join(f"r{r}:{h[0]}..{h[-1]}" for r, h in enumerate(i.head_index))
            rows.append((f"{i.module}({i.argument})", "input", f"{i.heads} heads", str(i.dim), "", heads))
        for name in self.grad_allreduce:
            rows.append((name, "replicated", "", "-", "", "gradient all-reduced"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _local(p: ParamLayout, ranks) -> str:
    """The local shape on `ranks`; along the split dim "a|b|c" where ranks hold different lengths (uneven)."""
    lengths = [p.local_shape(r)[p.dim] for r in ranks]
    if len(set(lengths)) == 1:
        return _shape(p.local_shape(ranks[0]))
    shape = [str(n) for n in p.full_shape]
    shape[p.dim] = "|".join(map(str, lengths))
    return "(" + ", ".join(shape) + ")"


def _shape(s) -> str:
    return "(" + ", ".join(map(str, s)) + ")"
