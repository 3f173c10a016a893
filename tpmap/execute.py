"""Execute a prepared plan (`tpmap.prepare`) on this rank and attach what a tensor-parallel model carries: the
plan and its group, sequence parallelism's hooks, loss_parallel, the input check. `tpmap.apply` and
`tpmap.from_pretrained` both end here; the model is changed only from here on."""
from __future__ import annotations

from torch import nn

from tpmap.api_errors import PartialMappingWarning, warn
from tpmap.engine import shard, shm
from tpmap.engine.sequence import install_sequence_parallel
from tpmap.input_check import check_generate_arguments, input_check
from tpmap.loss_parallel import use_loss_parallel
from tpmap.prepare import Prepared

PLAN_ATTR = "tpmap_plan"  # the applied Plan is kept on the model under this name
GROUP_ATTR = "tpmap_group"  # and the process group it was sharded over (None: the default group)
SEQUENCE_ATTR = "tpmap_sequence"  # sequence parallelism's state (engine.sequence), when it is on


def apply_plan(model: nn.Module, prepared: Prepared, *, read=None) -> nn.Module:
    """Execute a checked plan on `model` for this rank and attach what a tensor-parallel model carries (the
    plan, loss_parallel, the input check). `read` gives each split tensor's local part (default: sliced
    from the model's own tensor; `tpmap.from_pretrained` reads it from the checkpoint)."""
    plan, group, tp_rank = prepared.plan, prepared.place.group, prepared.place.tp_rank
    if plan.tp_size > 1:  # the collectives' path, decided now on every rank (TPMAP_SHM=1 that cannot: raised here)
        shm.for_group(group)
    warn_partial = bool(plan.kept_whole) and tp_rank == 0
    params_full = sum(p.numel() for p in model.parameters()) if warn_partial else 0
    shard.execute(model, plan, tp_rank, group, **({} if read is None else {"read": read}))
    setattr(model, PLAN_ATTR, plan)
    setattr(model, GROUP_ATTR, group)  # full_state_dict and save_pretrained default to it
    if warn_partial:
        _warn_partial(plan, sum(p.numel() for p in model.parameters()) / params_full)
    if prepared.sequence is not None:
        setattr(model, SEQUENCE_ATTR, install_sequence_parallel(model, prepared.sequence, group))
    if prepared.loss_parallel:
        head = next(m for m in plan.modules if m.style == "vocab_head")
        use_loss_parallel(model, model.get_submodule(head.name))
    if prepared.check_inputs:
        forward_check = input_check(model, group)
        model.register_forward_pre_hook(forward_check, with_kwargs=True)
        if callable(getattr(model, "generate", None)):
            check_generate_arguments(model, group, forward_check)
    return model


_WARNED: set[tuple[str, int]] = set()


def _warn_partial(plan, share: float) -> None:
    """Once per process and (mapping, tp_size), on rank 0: which blocks a partial mapping keeps whole."""
    if (plan.source, plan.tp_size) in _WARNED:
        return
    _WARNED.add((plan.source, plan.tp_size))
    blocks = "; ".join(f"{pattern} ({count} module{'s' * (count != 1)}): {reason}"
                       for pattern, reason, count in plan.kept_whole)
    warn(f"{plan.source} is a partial mapping: these blocks stay whole on every rank -- {blocks}. "
                  f"Each rank holds {share:.1%} of the parameters at tp_size {plan.tp_size} "
                  f"(1/{plan.tp_size} = {1 / plan.tp_size:.1%} would be a complete split).",
                  PartialMappingWarning)
