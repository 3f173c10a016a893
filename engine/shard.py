"""Execute a plan on one rank: slice tensors, build parallel modules, then swap them in.

All new modules are built before the first swap, and building only reads the model, so an error in
building leaves the model as it was. Swapping and setting attributes cannot fail on user input (the
plan already checked it).

Bare tensors (Param) are cut in place, and the entries that change what a module's forward sees or
returns (Reduce, Input) become forward hooks on the unchanged module, so state-dict names never change.

Also here, because they follow from the plan alone: gradient hooks for parameters whose gradient
is partial on each rank (replicated KV heads, `grad_allreduce` modules) or must stay on one rank
(partial Params), and `full_tensor`, the inverse of `take`, which gathers a sharded parameter back
into the full tensor.
"""
from __future__ import annotations

import collections
import copy
import types
import weakref

import torch
import torch.distributed as dist
from torch import nn

from tpmap.engine import rng
from tpmap.engine.collectives import SharedCopy, all_reduce_, copy_to_tp_region, reduce_from_tp_region
from tpmap.engine.layers import (
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    RankModuleList,
    RowParallelLinear,
    ShardedNorm,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)
from tpmap.engine.plan import InputSlice, ModuleShard, ParamLayout, Plan, RouteSlice
from tpmap.engine.planner import resolve_attr


def take(full: torch.Tensor, shard: ParamLayout, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor, as a new contiguous tensor (zero-padded to local_size).
    A partial tensor is whole on rank 0 and zeros on the others."""
    if shard.partial:
        return full.detach().clone() if rank == 0 else torch.zeros_like(full.detach())
    if shard.dim is None:
        return full.detach().clone()
    parts = [full.narrow(shard.dim, s, n) for s, n in shard.pieces[rank]]
    if shard.local_size is not None:
        pad = shard.local_size - sum(n for _, n in shard.pieces[rank])
        if pad:
            shape = list(full.shape)
            shape[shard.dim] = pad
            parts.append(full.new_zeros(shape))
    return torch.cat(parts, dim=shard.dim).detach().contiguous() if len(parts) > 1 else parts[0].detach().clone()


def full_tensor(local: torch.Tensor, shard: ParamLayout, group=None, dst: int | None = None) -> torch.Tensor | None:
    """The full tensor from every rank's slice (a collective: call it on every rank). With `dst` (a rank
    of the group), only that rank gets it and the others None: nothing is gathered on them."""
    rank = dist.get_rank(group)
    if shard.partial:  # rank 0 holds it
        if dst == 0:
            return local.detach().clone() if rank == 0 else None
        full = local.detach().clone()
        dist.broadcast(full, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return full if dst is None or rank == dst else None
    if shard.dim is None:
        return local.detach().clone() if dst is None or rank == dst else None
    local = _padded(local.detach().contiguous(), shard)  # an uneven split: every rank sends the longest local
    if dst is None:
        parts = [torch.empty_like(local) for _ in range(len(shard.pieces))]
        dist.all_gather(parts, local, group=group)
    else:
        parts = [torch.empty_like(local) for _ in range(len(shard.pieces))] if rank == dst else None
        dist.gather(local, parts, dst=dist.get_global_rank(group, dst) if group is not None else dst, group=group)
        if rank != dst:
            return None
    return assemble(parts, shard)


def _padded(local: torch.Tensor, shard: ParamLayout) -> torch.Tensor:
    """`local` zero-padded along the split dim to the longest rank's local length (collectives move equal
    shapes); itself where every rank holds as many (even splits, padded vocabularies)."""
    longest = max(shard.local_shape(r)[shard.dim] for r in range(len(shard.pieces)))
    short = longest - local.shape[shard.dim]
    if not short:
        return local
    shape = list(local.shape)
    shape[shard.dim] = short
    return torch.cat([local, local.new_zeros(shape)], dim=shard.dim)


def assemble(parts: list[torch.Tensor], shard: ParamLayout) -> torch.Tensor:
    """The full tensor from every rank's local tensor (`take`'s inverse; padding dropped)."""
    full = parts[0].new_empty(shard.full_shape)
    for rank, part in enumerate(parts):
        offset = 0
        for start, n in shard.pieces[rank]:  # replicated heads are written by each holder, identically
            full.narrow(shard.dim, start, n).copy_(part.narrow(shard.dim, offset, n))
            offset += n
    return full


def norm_copies(shard: ParamLayout | None, rank: int, weight) -> torch.Tensor | None:
    """How many times each of `rank`'s features of a Norm is held over all ranks (replicated key/value heads
    of an uneven split), on the weight's device; None where every feature is held once."""
    if shard is None or not shard.replicated_heads:
        return None
    count = collections.Counter(i for r in range(len(shard.pieces)) for i in shard.indices(r))
    return torch.tensor([count[i] for i in shard.indices(rank)], dtype=torch.long, device=weight.device)


def norm_groups(shard: ParamLayout | None, rank: int, group_size: int, weight) -> tuple[torch.Tensor | None, bool]:
    """For a Norm with a statistic per group of `group_size` features: (the group of each of `rank`'s features,
    on the weight's device, or None; whether every rank holds only whole groups, each once and contiguous, so
    that each computes its statistics locally). Decided from every rank's pieces, so that all ranks agree on
    whether the sums are all-reduced (a collective that some ranks skip would hang). One group spanning the
    whole dim is the plain statistic: (None, False)."""
    if shard is None or not group_size or group_size == shard.full_shape[0]:  # one group: the plain statistic
        return None, False
    ranks = range(len(shard.pieces))
    local = not shard.replicated_heads and all(
        all(idx[k:k + group_size] == list(range(idx[k], idx[k] + group_size)) and idx[k] % group_size == 0
            for k in range(0, len(idx), group_size)) and len(idx) % group_size == 0
        for idx in (shard.indices(r) for r in ranks))
    if local:
        return None, True
    index = [i // group_size for i in shard.indices(rank)]
    return torch.tensor(index, dtype=torch.long, device=weight.device), False


def gather_width(shard: ParamLayout) -> int | None:
    """For Column gather_output at an uneven split: the widest rank's width, to which every rank pads its
    output so that the all-gather moves equal blocks; None when every rank holds the same width."""
    widths = {len(shard.indices(r)) for r in range(len(shard.pieces))}
    return max(widths) if len(widths) > 1 else None


def gather_order(shard: ParamLayout) -> torch.Tensor | None:
    """For Column gather_output: position in the rank-major all-gather (of blocks padded to `gather_width`
    at an uneven split) of each full feature, or None if the all-gather is already in feature order."""
    width, ranks = gather_width(shard), range(len(shard.pieces))
    if width is None:
        concat = [i for r in ranks for i in shard.indices(r)]
        if concat == list(range(len(concat))):
            return None
        where = {feature: pos for pos, feature in enumerate(concat)}
    else:  # rank r's j-th feature sits at r * width + j
        where = {feature: r * width + j for r in ranks for j, feature in enumerate(shard.indices(r))}
    return torch.tensor([where[f] for f in range(len(where))], dtype=torch.long)


def _build(old: nn.Module, ms: ModuleShard, rank: int, group, param) -> nn.Module:
    weight = None if ms.weight is None else param(old.weight, ms.weight)  # None: a weightless Norm
    bias = None if ms.bias is None else param(old.bias, ms.bias)
    if ms.style == "vocab_embedding":
        start, n = ms.weight.pieces[rank][0]
        # keeps the class's own forward (e.g. a scaled embedding) around the parallel lookup
        new = VocabParallelEmbedding.replacing(old, weight, vocab_start=start, vocab_end=start + n, group=group)
    elif ms.style == "vocab_head":
        start, n = ms.weight.pieces[rank][0]
        new = VocabParallelLMHead(weight, bias, vocab_start=start, vocab_end=start + n,
                                  vocab_size=ms.weight.full_shape[0], group=group)
    elif ms.style == "norm":
        groups, local = norm_groups(ms.weight, rank, ms.group_size, weight)
        new = ShardedNorm(weight, bias, statistic=ms.statistic, eps=ms.eps,
                          features=0 if ms.weight is None else ms.weight.full_shape[0], group=group,
                          copies=norm_copies(ms.weight, rank, weight), group_size=ms.group_size,
                          groups=groups, local_groups=local, gate=ms.gate)
    elif isinstance(old, nn.Embedding):
        new = ColumnParallelEmbedding(weight, old, group=group)
    elif ms.style == "column":
        order = gather_order(ms.weight) if ms.gather_output else None
        order = order.to(weight.device) if order is not None else None  # the shard's device (old may be on meta)
        new = ColumnParallelLinear(weight, bias, reverse=ms.reverse, group=group,
                                   gather_order=order, gather_output=ms.gather_output, copy_input=ms.copy_input,
                                   gathered_features=ms.weight.full_shape[1 if ms.reverse else 0],
                                   gather_width=gather_width(ms.weight) if ms.gather_output else None)
    else:
        new = RowParallelLinear(weight, bias, reverse=ms.reverse, group=group)
    new.train(old.training)
    return new


def execute(model: nn.Module, plan: Plan, rank: int, group, read=take) -> None:
    """Shard `model` in place for `rank`. ``read(full, shard, rank)`` gives this rank's local tensor of each
    split tensor: `take` slices the model's own full tensor; `tpmap.from_pretrained` passes a reader that
    reads the slice from a checkpoint instead (the model's full tensors then sit on the meta device)."""
    new_params: dict[int, nn.Parameter] = {}  # id(full parameter) -> its shard: tied weights stay one tensor

    def param(full: nn.Parameter, shard: ParamLayout) -> nn.Parameter:
        if id(full) not in new_params:
            new_params[id(full)] = nn.Parameter(read(full.data, shard, rank), requires_grad=full.requires_grad)
        return new_params[id(full)]

    new = {ms.name: _build(model.get_submodule(ms.name), ms, rank, group, param) for ms in plan.modules}
    cut = [(t, _cut(model, t, rank, param, read)) for t in plan.tensors]
    aliases = [(n, model.get_parameter(n)) for p in plan.params.values() if p.aliases for n in (p.name, *p.aliases)]
    for name, module in new.items():
        model.set_submodule(name, module)
    for t, value in cut:
        owner, _, attr = t.name.rpartition(".")
        setattr(model.get_submodule(owner), attr, value)
    for name in plan.reduces:
        _reduce_output(model.get_submodule(name), group)
    for name in plan.enters:
        _enter_output(model.get_submodule(name), group)
    for input_slice in plan.inputs:
        _slice_input(model.get_submodule(input_slice.module), input_slice, rank)
    for route in plan.routes:  # after the Reduce's pre-hook: the weights' copy is masked, not the original
        _route_experts(model.get_submodule(route.module), route, rank)
    for alias, old in aliases:  # other holders of a sharded tensor (e.g. a head's tied bias) see the shard
        owner, _, attr = alias.rpartition(".")
        module = model.get_submodule(owner)
        if getattr(module, attr) is old:
            setattr(module, attr, new_params[id(old)])
    _set_attributes(model, plan, rank)
    _register_grad_hooks(model, plan, group)
    _share_copies(model, plan)
    _watch_dropout(model, new.values())


def _share_copies(model: nn.Module, plan: Plan) -> None:
    """The Columns that copy the same input tensor share its copy: one all-reduce of the input gradient
    instead of one each (q, k and v; gate and up; an encoder's output read by every cross attention's k
    and v). One `SharedCopy` scoped to the model's forward."""
    columns = [ms.name for ms in plan.modules if ms.style == "column" and ms.copy_input]
    if not columns:
        return
    shared = SharedCopy()
    model.register_forward_pre_hook(shared.open)
    model.register_forward_hook(shared.close, always_call=True)
    for name in columns:
        model.get_submodule(name).__dict__["shared_copy"] = shared


def _watch_dropout(model: nn.Module, modules) -> None:
    """Give the parallel modules the model's `rng.DropoutWatch` and rescan it on every ``model.train(...)``
    (eval() calls train(False)): a bound method on the instance, so a deep copy rebinds it to the copy."""
    watch = rng.DropoutWatch(model)
    for module in modules:
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.__dict__["dropout_watch"] = watch
    model.__dict__["tpmap_dropout_watch"] = watch
    model.train = types.MethodType(_train_and_rescan, model)
    guard = rng.RegionGuard()
    model.register_forward_pre_hook(guard.open)
    model.register_forward_hook(guard.close, always_call=True)


def _train_and_rescan(self: nn.Module, mode: bool = True) -> nn.Module:
    type(self).train(self, mode)
    self.tpmap_dropout_watch.rescan()
    return self


def _cut(model: nn.Module, t: ParamLayout, rank: int, param, read):
    """This rank's part of a Param tensor: a new Parameter, a new buffer, or a RankModuleList."""
    owner, _, attr = t.name.rpartition(".")
    old = getattr(model.get_submodule(owner), attr)
    if t.holder == "parameter":
        return param(old, t)
    if t.holder == "buffer":
        return read(old, t, rank)
    return RankModuleList(t.indices(rank), old)


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def map_first_tensor(output, op):
    """`op` applied to a module's output: a tensor, or the first tensor of a tuple or list (the hidden
    states of a block that also returns attention weights or a cache); None when the output is neither."""
    if isinstance(output, torch.Tensor):
        return op(output)
    if not isinstance(output, (tuple, list)) or not output or not isinstance(output[0], torch.Tensor):
        return None
    if isinstance(output, list):
        return [op(output[0]), *output[1:]]
    if hasattr(output, "_fields"):  # a namedtuple keeps its type
        return type(output)(op(output[0]), *output[1:])
    return (op(output[0]),) + output[1:]


def _on_output(module: nn.Module, op, kind: str) -> None:
    """Apply `op` to the module's output (a tensor, or the first tensor of a tuple) in a forward hook."""
    def hook(_, args, output):
        mapped = map_first_tensor(output, op)
        if mapped is not None:
            return mapped
        raise TypeError(f"{type(module).__name__} under a {kind} entry returned {type(output).__name__}; "
                        f"{kind} takes a tensor output (or the first tensor of a tuple)")

    hook.tpmap_entry = kind  # an adapter wrapping the module takes the hook over (tpmap.peft)
    module.register_forward_hook(hook)


def _reduce_output(module: nn.Module, group) -> None:
    """Reduce: floating inputs enter the TP region (gradient all-reduced), the output is summed."""
    def enter(_, args, kwargs):
        args = tuple(copy_to_tp_region(a, group) if _floating(a) else a for a in args)
        kwargs = {k: copy_to_tp_region(v, group) if _floating(v) else v for k, v in kwargs.items()}
        return args, kwargs

    enter.tpmap_entry = "Reduce"
    module.register_forward_pre_hook(enter, with_kwargs=True)
    _on_output(module, lambda y: reduce_from_tp_region(y, group), "Reduce")


def _enter_output(module: nn.Module, group) -> None:
    """Enter: the output passes copy_to_tp_region (identity forward, gradient all-reduced)."""
    _on_output(module, lambda y: copy_to_tp_region(y, group), "Enter")


def _route_experts(module: nn.Module, spec: RouteSlice, rank: int) -> None:
    """Route: expert ids -> this rank's local ids, ids held elsewhere -> the sentinel n_r (the rank's expert count,
    which transformers' experts implementations skip), and their routing weights zeroed.

    ids (..., k) in [0, E); rank r holds experts [s, s + n_r): local = id - s where s <= id < s + n_r, else n_r.
    weights (..., k): w * held. Its gradient is this rank's experts' terms only; the Reduce's pre-hook (before
    this one) all-reduces it, so the router sees the sum over all experts."""
    start, count = spec.held[rank]

    def remap(_, args, kwargs):
        args = list(args)

        def get(name, position):  # position: in the bound forward's signature, as args are passed
            return kwargs[name] if name in kwargs else args[position] if position < len(args) else None

        def put(name, position, value):
            if name in kwargs:
                kwargs[name] = value
            else:
                args[position] = value

        ids = get(spec.index, spec.index_position)
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{spec.module}: its Route entry's index argument {spec.index!r} is "
                            f"{type(ids).__name__}, not a tensor of expert ids")
        held = (ids >= start) & (ids < start + count)
        put(spec.index, spec.index_position, torch.where(held, ids - start, torch.full_like(ids, count)))
        if spec.weights is not None:
            weights = get(spec.weights, spec.weights_position)
            if isinstance(weights, torch.Tensor):
                put(spec.weights, spec.weights_position, weights * held.to(weights.dtype))
        inputs[:] = [t for t in (*args, *kwargs.values()) if _floating(t) and t.requires_grad]
        return tuple(args), kwargs

    def tie(_, args, output):
        """A rank none of whose experts drew a token returns zeros that depend on no input: its inputs' copies
        (the Reduce's, whose backward all-reduces their gradients) would then take no part in backward, and
        that rank would skip the all-reduces the others run. One element of each, times zero, keeps them in."""
        if not inputs:
            return output
        zero = sum(t.reshape(-1)[:1].sum() for t in inputs) * 0
        inputs.clear()
        return map_first_tensor(output, lambda y: y + zero.to(y.dtype))

    inputs: list[torch.Tensor] = []
    remap.tpmap_entry = "Route"
    module.register_forward_pre_hook(remap, with_kwargs=True)
    module.register_forward_hook(tie)
    if hasattr(module, "_is_expert_parallel"):  # transformers' experts implementations: mask the sentinel rows
        module._is_expert_parallel = True  # (grouped_mm leaves them uninitialized, NaN * 0 would reach the sum)


def _slice_input(module: nn.Module, spec: InputSlice, rank: int) -> None:
    """Input: keep this rank's heads of one forward argument (a dim of size 1 broadcasts: left whole)."""
    heads = spec.head_index[rank]
    start, n = heads[0], len(heads)  # a rank's heads are contiguous

    def cut(t):
        if not isinstance(t, torch.Tensor):
            return t
        dim = spec.dim % t.dim()
        size = t.shape[dim]
        if size == 1:
            return t
        if spec.flattened:
            if size % spec.heads:
                raise RuntimeError(f"{spec.module}({spec.argument}): dim {spec.dim} has {size} entries, not batch x "
                                   f"{spec.heads} heads; check the mapping's Input entry {spec.entry}")
            view = t.unflatten(dim, (size // spec.heads, spec.heads))
            return view.narrow(dim + 1, start, n).flatten(dim, dim + 1)
        if size != spec.heads:
            raise RuntimeError(f"{spec.module}({spec.argument}): dim {spec.dim} has {size} entries, not the "
                               f"{spec.heads} heads of the mapping's Input entry {spec.entry}")
        return t.narrow(dim, start, n)

    def hook(_, args, kwargs):
        if spec.argument in kwargs:
            kwargs = {**kwargs, spec.argument: cut(kwargs[spec.argument])}
        elif spec.position < len(args):
            args = args[:spec.position] + (cut(args[spec.position]),) + args[spec.position + 1:]
        return args, kwargs

    hook.tpmap_entry = "Input"
    module.register_forward_pre_hook(hook, with_kwargs=True)


def _set_attributes(model: nn.Module, plan: Plan, rank: int) -> None:
    config_copies: dict[int, object] = {}  # one per-rank copy per original config object
    for u in plan.updates:
        module = model.get_submodule(u.module)
        if u.via_config:  # give the owner of the config its own copy; the shared config keeps full sizes
            *owner_path, cfg_attr, _ = u.attribute.split(".")
            owner = module
            for part in owner_path:
                owner = getattr(owner, part)
            original = getattr(owner, cfg_attr)
            if id(original) not in config_copies:
                config_copies[id(original)] = copy.copy(original)
            setattr(owner, cfg_attr, config_copies[id(original)])
        owner, attr, _ = resolve_attr(module, u.attribute)
        setattr(owner, attr, u.values[rank])


def _register_grad_hooks(model: nn.Module, plan: Plan, group) -> None:
    """Gradients that are partial on each rank are summed in backward:

    * `grad_allreduce` parameters (replicated, but each rank saw only its shard of the activations);
    * pieces of replicated KV heads: each holder saw only its own query heads, so the holders' grads
      are summed (added into a full-size buffer, all-reduced, sliced back): every copy of a head, on
      several ranks or twice on one (uneven splits), then holds the unsharded gradient of that head;
    * items of a ModuleList cut by a Param entry and held by several ranks (a per-KV-head norm): the list sums
      them itself, through one `sum_items_over_holders` node per list (`RankModuleList.share_over`).
    """
    for name in plan.grad_allreduce:
        _on_gradient(model, name, lambda g: all_reduced(g, group))
    for shard in plan.params.values():
        if shard.partial and dist.get_rank(group) != 0:  # kept on rank 0 only: the others stay zero
            _on_gradient(model, shard.name, torch.zeros_like)
        if shard.replicated_heads and shard.holder == "parameter":
            index = torch.tensor(shard.indices(dist.get_rank(group)), dtype=torch.long)
            _on_gradient(model, shard.name, lambda g, s=shard, i=index: sum_over_holders(g, s, i, group))
    for shard in plan.tensors:
        if shard.replicated_heads and shard.holder == "modules":
            model.get_submodule(shard.name).share_over(shard.full_shape[0], group)


def _on_gradient(model: nn.Module, name: str, hook) -> None:
    """`hook` on the gradient of parameter `name`, and on any parameter found in its place when its module
    runs: FSDP2's `fully_shard` (data parallelism around tensor parallelism) replaces every parameter by a
    sharded DTensor and, for forward, by an unsharded plain one, which is what receives the gradient."""
    from torch.distributed.tensor import DTensor

    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    hooked: list[weakref.ref] = []  # each parameter object once (a hook registered twice would apply twice)

    def hook_current(module, args):
        p = module._parameters.get(attr)
        if p is None or not p.requires_grad or isinstance(p, DTensor) or any(r() is p for r in hooked):
            return
        p.register_hook(hook)
        hooked[:] = [r for r in hooked if r() is not None] + [weakref.ref(p)]

    hook_current(owner, ())
    owner.register_forward_pre_hook(hook_current)


def all_reduced(grad: torch.Tensor, group) -> torch.Tensor:
    return all_reduce_(grad.contiguous().clone(), group)


def sum_over_holders(grad: torch.Tensor, shard: ParamLayout, index: torch.Tensor, group) -> torch.Tensor:
    full = grad.new_zeros(shard.full_shape)
    index = index.to(grad.device)  # the model may have moved to another device after apply
    full.index_add_(shard.dim, index, grad)  # a head held twice on this rank (uneven KV heads): both terms
    all_reduce_(full, group)
    return full.index_select(shard.dim, index)
