"""Which checkpoint tensors make each model tensor, and reading a model tensor (or one rank's slice) from them.

Names follow transformers' own loading rules, reused, not copied: the conversion mapping of the model
(`transformers.conversion_mapping.get_model_conversion_mapping`: legacy renames such as
``LayerNorm.gamma``, ``block_sparse_moe`` -> ``mlp``, per-expert 2-D tensors fused into 3-D expert
parameters), applied key by key with `transformers.core_model_loading.rename_source_key` (every
renaming, then at most one converter, the base-model prefix added or dropped), and the conversion ops
run by the converter's own ``convert``.

A converted tensor is still read lazily when the converter only moves elements around (stacks, concat,
chunks, transposes): `_plan_lazy` runs the converter on small *probe* tensors whose values name their
origin (which stored tensor, which index along one of its dims) and learns, for every index of the
target's split dim, which rows of which stored tensors it is made of. The rank then reads only those
rows and runs the converter on them; the probes, run the same way on just those rows, must come out
as exactly the rank's slice in its order, or the conversion is not read lazily. Probes run twice with
shifted values: an op that computes with values (a dequantization, a scale) is refused, not guessed.

A converter may decide by the input's shape (transformers' ``Transpose(check_dims=True)`` transposes only
a tensor whose shape is not the model's, so a square one stays as stored): the torch ops a probe runs must
be the ops the converter runs on the stored shapes and on the rows read (`_Trace` on meta tensors), and a
converter that hands a model-shaped tensor back as it is counts as no conversion.

A one-to-many conversion that selects stored rows (a fused q|k|v chunked into three targets, each split
its own way) is read as that selection (`_plan_selection`), without running the converter. A conversion
that cannot be sliced either way falls back to `Reader` converting the whole tensor and slicing it
(`engine.shard.take`): one full converted tensor (and its sources) in memory at a time, said once per
converter in a warning. `benchmarks/load.py --whole-conversions` measures that path.
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field

import torch

from tpmap.api_errors import warn
from tpmap.checkpoint.errors import CheckpointError
from tpmap.checkpoint.safetensors import Checkpoint, StoredTensor
from tpmap.engine.plan import ParamLayout
from tpmap.engine.shard import take
from tpmap.engine.slice_io import Scratch, read_local, read_whole

logger = logging.getLogger(__name__)

_BIG = 2 ** 24  # probe value = origin * _BIG + index: exact in float64 for 2**29 origins
_SHIFT = 12345.0
LAZY_CONVERSIONS = True  # False: always convert whole tensors (the fallback), for benchmarks/load.py


@dataclass
class Source:
    """The stored tensors one model tensor (or, for a one-to-many converter, several) is made of."""
    target: str  # the first model tensor it gives (transformers groups a converter's inputs under it)
    stored: list[tuple[str, StoredTensor]] = field(default_factory=list)  # (source pattern, tensor), in order
    converter: object | None = None  # a transformers WeightConverter (template, never fed); None: stored as is
    produces: dict[str, tuple[int, ...] | None] = field(default_factory=dict)  # model tensor -> shape (None: unknown)
    ops: tuple[str, ...] | None = None  # the torch ops the converter runs on the stored shapes (None: unknown)

    def where(self) -> str:
        first = self.stored[0][1].where()
        return first if len(self.stored) == 1 else f"{first} and {len(self.stored) - 1} more tensors"


def match_checkpoint_names(model, checkpoint: Checkpoint, conversions) -> tuple[dict[str, Source], set[str]]:
    """(the Source of every model tensor the checkpoint holds, the checkpoint's unexpected keys), named
    exactly as transformers' `from_pretrained` names them; shapes checked against the model's."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    prefix = model.base_model_prefix
    groups: dict[str, Source] = {}
    unexpected: set[str] = set()
    for key in sorted(checkpoint.tensors, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if renamed not in expected and key in expected:  # should not have been renamed; maybe a prefix to add
            renamed, pattern = rename_source_key(key, [], [], prefix, expected)
        if renamed in expected:
            source = groups.setdefault(renamed, Source(renamed, converter=by_pattern[pattern] if pattern else None))
            if source.converter is None and source.stored:
                continue  # a second stored tensor for the same name: transformers keeps the first
            source.stored.append((pattern if pattern is not None else key, checkpoint.tensors[key]))
        elif pattern is not None:
            conv = by_pattern[pattern]
            unexpected.update(renamed.replace(conv.target_patterns[0], t) for t in conv.target_patterns)
        else:
            unexpected.add(renamed)
    sources: dict[str, Source] = {}
    for source in groups.values():
        source.produces = _produces(source, model)
        for name, shape in source.produces.items():
            if name not in expected:
                unexpected.add(name)
                continue
            if shape is not None and shape != expected[name]:
                made = "is stored as" if source.converter is None else "is made from the checkpoint with shape"
                raise CheckpointError(
                    f"{source.where()}: model tensor {name} {made} {list(shape)} but {type(model).__name__} built "
                    f"from the folder's config.json expects {list(expected[name])}; the config does not describe "
                    "this checkpoint (a wrong or edited config.json, or a config override passed to from_pretrained)")
            sources[name] = source
    return sources, unexpected


def _produces(source: Source, model) -> dict[str, tuple[int, ...] | None]:
    """Model tensor name -> shape for everything `source` gives; a converter is run on meta tensors."""
    if source.converter is None:
        return {source.target: source.stored[0][1].shape}
    try:
        tensors = [torch.empty(t.shape, dtype=t.dtype, device="meta") for _, t in source.stored]
        with _Trace() as trace:
            out = _convert(source, tensors, model)
        source.ops = tuple(trace.ops)
    except Exception as e:  # an op that needs values: the shapes are checked after converting instead
        logger.debug("cannot run %s on meta tensors: %s", source.converter, e)
        return {source.target: None}
    if len(tensors) == 1 and list(out) == [source.target] and out[source.target] is tensors[0]:
        source.converter = None  # it hands the stored tensor back as is (Transpose(check_dims), model-shaped)
        return {source.target: source.stored[0][1].shape}
    return {name: tuple(t.shape) for name, t in out.items()}


def _convert(source: Source, tensors: list[torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Run the transformers converter of `source` on `tensors` (one per stored tensor, in order)."""
    conv = copy.deepcopy(source.converter)
    for (pattern, stored), tensor in zip(source.stored, tensors):
        conv.add_tensor(source.target, stored.name, pattern, tensor)
    out = conv.convert(source.target, model=model, config=model.config)
    return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


class _Trace(torch.overrides.TorchFunctionMode):
    """Records the names of the torch functions and tensor methods run inside it, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.ops.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class _Lazy:
    """How to read one rank's slice of a converted tensor: per stored tensor, None (skip it), "all", or
    ranges along `dim` of it; the converter run on those gives exactly the rank's slice, in order."""
    dim: int | None  # the stored tensors' dim that becomes the target's split dim (None: whole tensors)
    reads: tuple  # per stored tensor


class Reader:
    """Reads model tensors from their checkpoint sources: whole, or one rank's slice of them."""

    def __init__(self, model, sources: dict[str, Source], dtype_of, device, progress=None, dequantizer=None):
        self.model, self.sources, self.dtype_of, self.device = model, sources, dtype_of, device
        self.progress = progress
        # a tpmap.checkpoint.fp8.Fp8Scales or compressed.CompressedWeights: the stored weights it has scales for are
        # dequantized by its read()
        self.dequantizer = dequantizer
        self.expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # full shapes, before sharding
        self.scratch = Scratch()  # blocks of rows; a tensor on its way to another dtype or device
        self._lazy: dict[tuple, _Lazy | None] = {}
        self._outputs: dict[str, torch.Tensor] = {}  # a one-to-many conversion's other outputs, until asked for
        self._warned: set[str] = set()

    def _done(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.progress is not None:
            self.progress.update(1)
        return tensor.to(self.device)

    def _final(self, tensor: torch.Tensor, dtype: torch.dtype, in_scratch: bool) -> torch.Tensor:
        """A tensor read in the stored dtype on the CPU, as the model keeps it (`dtype`, `device`)."""
        if not in_scratch:
            return tensor
        out = torch.empty(tensor.shape, dtype=dtype, device=self.device)
        out.copy_(tensor)
        return out

    def whole(self, name: str) -> torch.Tensor:
        source, dtype = self.sources[name], self.dtype_of(name)
        if source.converter is None:
            stored = source.stored[0][1]
            if self.scale_of(stored) is not None:
                return self._done(self.dequantizer.read(stored, None, 0, dtype, self.device, self.scratch))
            copy_out = stored.dtype != dtype or self.device.type != "cpu"
            tensor = read_whole(stored.read_into, stored.shape, stored.dtype, self.scratch if copy_out else None)
            return self._done(self._final(tensor, dtype, copy_out))
        out = self._converted(name)
        release_freed_memory()
        return self._done(out)

    def local(self, name: str, shard: ParamLayout, rank: int) -> torch.Tensor:
        """This rank's tensor, as `take(whole(name), shard, rank)` would give it, reading only its slice."""
        source, dtype = self.sources[name], self.dtype_of(name)
        if source.converter is None:
            stored = source.stored[0][1]
            if self.scale_of(stored) is not None:
                return self._done(self.dequantizer.read(stored, shard, rank, dtype, self.device, self.scratch))
            copy_out = stored.dtype != dtype or self.device.type != "cpu"
            tensor = read_local(stored.read_into, shard, rank, stored.dtype, self.scratch, in_scratch=copy_out)
            return self._done(self._final(tensor, dtype, copy_out))
        if shard.partial and rank != 0:
            return self._done(torch.zeros(shard.full_shape, dtype=dtype))
        if shard.dim is None or shard.partial:
            out = self._converted(name)
            release_freed_memory()
            return self._done(out)
        lazy = self._plan_for(name, source, shard, rank) if LAZY_CONVERSIONS else None
        if lazy is None:
            picked = self._selection_for(name, source, shard, rank) if LAZY_CONVERSIONS else None
            if picked is not None:
                return self._done(self._read_selection(name, source, shard, rank, picked, dtype))
            self._warn_whole(name, source)
            out = take(self._converted(name), shard, rank)
            release_freed_memory()
            return self._done(out)
        parts = []
        for (_, stored), how in zip(source.stored, lazy.reads):
            if how is None:
                continue
            parts.append(self._rows(stored, None if how == "all" else how, lazy.dim, dtype))
        kept = [st for st, how in zip(source.stored, lazy.reads) if how is not None]
        out = _convert(Source(source.target, kept, source.converter), parts, self.model)[name]
        del parts
        release_freed_memory()
        out = _padded(out, shard, rank)
        return self._done(out.contiguous())

    def _rows(self, stored: StoredTensor, runs, dim: int | None, dtype: torch.dtype) -> torch.Tensor:
        """The runs of rows ((start, length), ...) along `dim` of a stored tensor (None: all of it), in `dtype`
        on the CPU; block-quantized weights dequantized first, as transformers does before converting."""
        rows = None if runs is None else ParamLayout(name=stored.name, full_shape=stored.shape, dim=dim, pieces=(runs,))
        if self.scale_of(stored) is not None:
            part = self.dequantizer.read(stored, rows, 0, dtype, torch.device("cpu"), self.scratch)
        elif rows is None:
            part = read_whole(stored.read_into, stored.shape, stored.dtype)
        else:
            part = read_local(stored.read_into, rows, 0, stored.dtype, self.scratch)
        return part.to(dtype)

    def scale_of(self, stored: StoredTensor) -> StoredTensor | None:
        """The block scales of a quantized stored tensor (None: stored as its values)."""
        return self.dequantizer.scale_of(stored) if self.dequantizer is not None else None

    def _converted(self, name: str) -> torch.Tensor:
        """The whole converted tensor: every stored tensor read whole, the converter run on them."""
        if name in self._outputs:
            return self._outputs.pop(name)
        source, dtype = self.sources[name], self.dtype_of(name)
        parts = [self.dequantizer.read(t, None, 0, dtype, torch.device("cpu"), self.scratch)
                 if self.scale_of(t) is not None else read_whole(t.read_into, t.shape, t.dtype).to(dtype)
                 for _, t in source.stored]
        out = _convert(source, parts, self.model)
        del parts
        for other, tensor in out.items():
            if other != name and other in self.sources:
                self._outputs[other] = tensor
        result = out[name]
        if tuple(result.shape) != self.expected[name]:  # only possible when the shapes could not be checked on meta
            raise CheckpointError(f"{source.where()}: converted to {name} with shape {list(result.shape)} but the "
                                  f"model expects {list(self.expected[name])}; the config does not describe "
                                  "this checkpoint")
        return result

    def _warn_whole(self, name: str, source: Source) -> None:
        ops = ", ".join(type(op).__name__ for op in getattr(source.converter, "operations", []))
        if ops in self._warned:
            return
        self._warned.add(ops)
        why = "lazy conversion is switched off" if not LAZY_CONVERSIONS else "these ops cannot be sliced lazily"
        warn(f"tpmap: {name} is converted from {len(source.stored)} checkpoint tensors by transformers' "
                      f"{ops}; {why}, so every rank reads the whole tensor, converts it and keeps its slice (one full "
                      "converted tensor in memory at a time; benchmarks/load.py --whole-conversions measures it)")

    def _selection_for(self, name: str, source: Source, shard: ParamLayout, rank: int) -> _Selection | None:
        key = ("selection", id(source.converter), name, tuple(t.shape for _, t in source.stored), shard.full_shape,
               shard.dim, shard.pieces[rank])
        if key not in self._lazy:
            self._lazy[key] = _plan_selection(source, name, shard, rank, self.model)
        return self._lazy[key]

    def _read_selection(self, name: str, source: Source, shard: ParamLayout, rank: int, picked: _Selection,
                        dtype: torch.dtype) -> torch.Tensor:
        """The rank's slice of a converted tensor that is a selection of stored rows: those rows read (sorted
        runs of each stored tensor), put in the converter's order; the converter itself does not run."""
        parts = []
        for (_, stored), how in zip(source.stored, picked.reads):
            if how is None:
                continue
            parts.append(self._rows(stored, how, picked.dim, dtype))
        out = torch.cat(parts, dim=picked.dim) if len(parts) > 1 else parts[0]
        out = out.index_select(picked.dim, picked.order)
        del parts
        out = _padded(out, shard, rank)
        return out.contiguous()

    def _plan_for(self, name: str, source: Source, shard: ParamLayout, rank: int) -> _Lazy | None:
        key = (id(source.converter), name.rsplit(".", 1)[-1], tuple(t.shape for _, t in source.stored),
               shard.full_shape, shard.dim, shard.pieces[rank])
        if key not in self._lazy:
            self._lazy[key] = _plan_lazy(source, name, shard, rank, self.model)
        return self._lazy[key]


def _padded(out: torch.Tensor, shard: ParamLayout, rank: int) -> torch.Tensor:
    """`out` with zero rows after it along the split dim up to the rank's local size (an uneven split's pad)."""
    pad = shard.local_shape(rank)[shard.dim] - out.shape[shard.dim]
    if not pad:
        return out
    shape = list(out.shape)
    shape[shard.dim] = pad
    return torch.cat([out, out.new_zeros(shape)], dim=shard.dim)


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere).

    A conversion's transient tensors (the stored slices, then what stacking and concatenating make of
    them) are a few MiB each; once glibc has raised its mmap threshold past their size they come from
    the heap and, freed, stay resident: measured +25% peak RSS on the Mixtral-shaped benchmark at world
    size 2 without this call, +2% with it."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def _probe(source: Source, name: str, dim: int | None, rows, shift: float, model, ops=None) -> torch.Tensor | None:
    """The converter's output `name` for probe inputs: stored tensor k (in order) becomes a float64
    tensor of size 1 in every dim but `dim`, valued k * _BIG + its index along `dim` (+ shift); with
    `dim` None, size 1 everywhere, valued k * _BIG. ``rows[k]`` (when rows is given): the indices of
    tensor k to keep, or None for all; an empty list leaves tensor k out. None if the ops fail, or if `ops`
    is given and the converter runs other torch ops on the probes."""
    tensors, kept = [], []
    for k, (pattern, stored) in enumerate(source.stored):
        keep = None if rows is None else rows[k]
        if keep is not None and len(keep) == 0:
            continue
        shape = [1] * len(stored.shape)
        index = [0]
        if dim is not None:
            index = list(range(stored.shape[dim])) if keep is None else keep
            shape[dim] = len(index)
        tensors.append((torch.tensor(index, dtype=torch.float64) + k * _BIG + shift).reshape(shape))
        kept.append((pattern, stored))
    try:
        with _Trace() as trace:
            out = _convert(Source(source.target, kept, source.converter), tensors, model)
    except Exception as e:  # the ops refuse these shapes: not sliceable this way
        logger.debug("probe of %s along dim %s failed: %s", name, dim, e)
        return None
    if ops is not None and tuple(trace.ops) != ops:  # the converter decides by shape: a probe is not the real thing
        logger.debug("probe of %s along dim %s runs %s, the stored shapes %s", name, dim, trace.ops, ops)
        return None
    result = out.get(name)
    return result if isinstance(result, torch.Tensor) and result.dtype == torch.float64 else None


def _plan_lazy(source: Source, name: str, shard: ParamLayout, rank: int, model) -> _Lazy | None:
    """A `_Lazy` for this rank's slice of the converted tensor `name`, or None if the conversion cannot
    be sliced (see the module docstring)."""
    if len(source.produces) != 1 or _stored_ops(source, model) is None or any(
            len(t.shape) != len(source.stored[0][1].shape) for _, t in source.stored):
        return None
    d, want = shard.dim, shard.indices(rank)
    full_shape = shard.full_shape
    for dim in (None, *range(len(source.stored[0][1].shape))):
        full = _probe(source, name, dim, None, 0.0, model, source.ops)
        if full is None or full.dim() != len(full_shape) or full.shape[d] != full_shape[d] or any(
                full.shape[i] not in (1, full_shape[i]) for i in range(len(full_shape))):
            continue
        shifted = _probe(source, name, dim, None, _SHIFT, model)
        if shifted is None or not torch.equal(shifted, full + _SHIFT):
            continue  # the ops compute with the values: not a pure rearrangement
        chosen = full.index_select(d, torch.tensor(want))
        origin = torch.div(chosen, _BIG, rounding_mode="floor").long()
        index = (chosen - origin * _BIG).long()
        reads: list = []
        rows: list = []
        for k in range(len(source.stored)):
            mine = origin == k
            if dim is None:  # whole stored tensors, or none of them
                used = bool(mine.any())
                reads.append("all" if used else None)
                rows.append(None if used else [])
                continue
            needed = sorted(set(index[mine].tolist()))
            rows.append(needed)
            reads.append(_ranges(needed) if needed else None)
        if all(r is None for r in reads):
            continue
        ops = _meta_ops(source, dim, rows, model)  # what the converter runs on the rows the rank reads
        sliced = _probe(source, name, dim, rows, 0.0, model, ops) if ops is not None else None
        if sliced is not None and sliced.shape == chosen.shape and torch.equal(sliced, chosen):
            return _Lazy(dim, tuple(reads))
    return None


@dataclass(frozen=True)
class _Selection:
    """One rank's slice of a converted tensor that is rows of the stored tensors along `dim` (every other
    dim as stored): per stored tensor, None or the sorted runs of rows to read; `order` puts the rows
    read (concatenated in stored order) in the converter's order."""
    dim: int
    reads: tuple
    order: torch.Tensor


_ORIGIN, _ROW = 2.0 ** 40, 2.0 ** 8  # selection probe value = origin * _ORIGIN + row * _ROW + position in other dims


def _plan_selection(source: Source, name: str, shard: ParamLayout, rank: int, model) -> _Selection | None:
    """A `_Selection` when the converter's output `name` is a selection of stored rows along the split dim
    (a one-to-many ``Chunk`` of fused q|k|v, an ``Interleave`` then ``Chunk``), else None.

    One probe per stored tensor k, full along the split dim d and 2 wide (1 where the tensor is) in every
    other dim, valued k * 2**40 + row * 2**8 + its flat position in the other dims: the output must keep
    every other dim exactly (same positions, same order), and each of its rows along d must be one stored
    row. Run again with shifted values it must shift (no arithmetic), and it must run the torch ops the
    converter runs on the stored shapes."""
    d = shard.dim
    ndim = len(shard.full_shape)
    if _stored_ops(source, model) is None or any(len(t.shape) != ndim for _, t in source.stored) or ndim > 8:
        return None
    shapes = [[n if i == d else min(n, 2) for i, n in enumerate(t.shape)] for _, t in source.stored]

    def probe(shift: float) -> torch.Tensor | None:
        tensors = []
        for k, shape in enumerate(shapes):
            other = [n for i, n in enumerate(shape) if i != d]
            grid = torch.arange(math.prod(other), dtype=torch.float64).reshape(other).unsqueeze(d)
            rows = torch.arange(shape[d], dtype=torch.float64).reshape([-1 if i == d else 1 for i in range(ndim)])
            tensors.append(k * _ORIGIN + rows * _ROW + grid + shift)
        try:
            with _Trace() as trace:
                out = _convert(source, tensors, model).get(name)
        except Exception as e:
            logger.debug("selection probe of %s failed: %s", name, e)
            return None
        if tuple(trace.ops) != source.ops or not isinstance(out, torch.Tensor) or out.dtype != torch.float64:
            return None
        return out

    full = probe(0.0)
    if full is None or full.dim() != ndim or full.shape[d] != shard.full_shape[d]:
        return None
    shifted = probe(_SHIFT)
    if shifted is None or not torch.equal(shifted, full + _SHIFT):
        return None  # the converter computes with the values
    if any(full.shape[i] != min(shard.full_shape[i], 2) for i in range(ndim) if i != d):
        return None  # the other dims must come out as stored (the probe is 2 wide there)
    origin = torch.div(full, _ORIGIN, rounding_mode="floor")
    row = torch.div(full - origin * _ORIGIN, _ROW, rounding_mode="floor")
    position = full - origin * _ORIGIN - row * _ROW
    other = [n for i, n in enumerate(full.shape) if i != d]
    grid = torch.arange(math.prod(other), dtype=torch.float64).reshape(other).unsqueeze(d)
    if not torch.equal(position, grid.expand_as(position)):
        return None  # the converter moves elements within the other dims
    along = [-1 if i == d else 1 for i in range(ndim)]
    o = origin.movedim(d, 0).reshape(full.shape[d], -1)[:, 0]
    r = row.movedim(d, 0).reshape(full.shape[d], -1)[:, 0]
    if not (torch.equal(origin, o.reshape(along).expand_as(origin))
            and torch.equal(row, r.reshape(along).expand_as(row))):
        return None  # an output row mixes stored rows
    want = torch.tensor(shard.indices(rank), dtype=torch.long)
    o, r = o[want].long(), r[want].long()
    reads, offset, where = [], 0, {}
    for k in range(len(source.stored)):
        needed = sorted(set(r[o == k].tolist()))
        reads.append(_ranges(needed) if needed else None)
        where.update({(k, i): offset + j for j, i in enumerate(needed)})
        offset += len(needed)
    if all(x is None for x in reads):
        return None
    order = torch.tensor([where[(int(k), int(i))] for k, i in zip(o, r)], dtype=torch.long)
    return _Selection(d, tuple(reads), order)


def _stored_ops(source: Source, model) -> tuple[str, ...] | None:
    """The torch ops the converter runs on the stored shapes (`Source.ops`, traced now for a Source that
    `match_checkpoint_names` did not make)."""
    if source.ops is None:
        source.ops = _meta_ops(source, 0, [None] * len(source.stored), model)
    return source.ops


def _meta_ops(source: Source, dim: int, rows: list, model) -> tuple[str, ...] | None:
    """The torch ops the converter runs on meta tensors shaped as the rows `rows[k]` of each stored tensor
    along `dim` (None: all of them; empty: tensor left out), or None if it fails on them."""
    tensors, kept = [], []
    for keep, (pattern, stored) in zip(rows, source.stored):
        if keep is not None and len(keep) == 0:
            continue
        shape = list(stored.shape)
        if keep is not None:
            shape[dim] = len(keep)
        tensors.append(torch.empty(shape, dtype=stored.dtype, device="meta"))
        kept.append((pattern, stored))
    try:
        with _Trace() as trace:
            _convert(Source(source.target, kept, source.converter), tensors, model)
    except Exception as e:
        logger.debug("%s on the rows read along dim %s fails on meta tensors: %s", source.target, dim, e)
        return None
    return tuple(trace.ops)


def _ranges(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted indices -> ((start, length), ...) runs."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, 1])
    return tuple((s, n) for s, n in out)


def equal(reader: Reader, a: str, b: str) -> bool:
    """Whether the model tensors `a` and `b` hold the same values (as loaded), compared a block of rows at a time."""
    sa, sb = reader.sources[a], reader.sources[b]
    if sa.produces.get(a) != sb.produces.get(b):
        return False
    ta, tb = sa.stored[0][1], sb.stored[0][1]
    if sa.converter is not None or sb.converter is not None or reader.scale_of(ta) or reader.scale_of(tb):
        return torch.equal(reader.whole(a), reader.whole(b))
    rows = ta.shape[0] if ta.shape else 1
    if not ta.shape:
        return torch.equal(read_whole(ta.read_into, (), ta.dtype).to(reader.dtype_of(a)),
                           read_whole(tb.read_into, (), tb.dtype).to(reader.dtype_of(b)))
    step = max(1, (64 << 20) // max(1, math.prod(ta.shape[1:]) * 4))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        block = ParamLayout(name=a, full_shape=ta.shape, dim=0, pieces=(((start, n),),))
        x = read_local(ta.read_into, block, 0, ta.dtype).to(reader.dtype_of(a))
        y = read_local(tb.read_into, block, 0, tb.dtype).to(reader.dtype_of(b))
        if not torch.equal(x, y):
            return False
    return True
