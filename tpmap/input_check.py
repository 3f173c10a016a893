"""Guards against ranks out of step: every rank of a tensor-parallel model must run the same forwards
on the same inputs, or the collectives pair up wrongly (garbage) or wait forever (a hang).

`input_check` is a forward pre-hook comparing a 5-number fingerprint of every tensor argument (and of the
RNG state in training mode) across the ranks, one all-gather per forward; `check_generate_arguments`
wraps `generate` to compare its settings once per call. Both raise `InputMismatchError` on every rank.
"""
from __future__ import annotations

import functools
import inspect
import math
import zlib

import torch
import torch.distributed as dist
from torch import nn

from tpmap.api_errors import InputMismatchError
from tpmap.engine.collectives import all_gather_stacked


def _tensors(args: tuple, kwargs: dict, positional: list[str]) -> list[tuple[str, torch.Tensor]]:
    """Every tensor argument of a forward call, by name (positional ones by the signature), including
    tensors inside a list or tuple argument; in a fixed order (by name) so ranks compare like with like."""
    named = dict(zip(positional, args)) | kwargs
    named |= {f"*args[{i}]": a for i, a in enumerate(args[len(positional):])}
    out = []
    for name, value in sorted(named.items()):
        if isinstance(value, torch.Tensor):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            out += [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return out


def _code(text: str) -> float:
    """A deterministic number for a string (the same on every rank, unlike hash())."""
    return float(zlib.crc32(text.encode()))


def _sums(t: torch.Tensor) -> tuple[float, float]:
    """(position-weighted sum, plain sum) of a tensor's values in float64: a reordering changes the first."""
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.float64:
        flat = flat.to(torch.float64)
    positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return float(flat @ positions), float(flat.sum())


def _digest(t: torch.Tensor) -> tuple[float, float]:
    """Two numbers that change when a value of `t` does. A plain CPU tensor (a forward's token ids): the CRC-32
    of its bytes, exact, and its size -- one pass in C, where the float64 sums take a conversion, a matmul and
    a reduction, which is most of the check's cost on a decode-sized forward. Elsewhere `_sums`, computed on
    the tensor's device (no copy to the host)."""
    if t.device.type == "cpu" and type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided \
            and not t.is_quantized:
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        flat = t.detach().reshape(-1)  # (a view of a contiguous tensor, else a copy)
        return float(zlib.crc32(flat.view(torch.uint8).numpy())), float(flat.numel())
    return _sums(t)


def _fingerprint(tensors: list[tuple[str, torch.Tensor]], rng_state: torch.Tensor | None) -> torch.Tensor:
    """Five float64 numbers for all tensor arguments together (fixed size, so one all-gather serves any
    call): how many; their names and shapes; two name-weighted digests of their values (`_digest`); and the
    default RNG state (training mode: ranks must draw the same dropout masks)."""
    names = sum(_code(f"{n}:{tuple(t.shape)}:{t.dtype}") for n, t in tensors)
    weighted = plain = 0.0
    for name, t in tensors:
        first, second = _digest(t)
        weighted += first * (1.0 + _code(name) / 2**32)
        plain += second
    rng = float(zlib.crc32(rng_state.numpy())) if rng_state is not None else 0.0
    row = [0.0 if math.isnan(v) else v for v in (len(tensors), names, weighted, plain, rng)]  # NaN != NaN:
    return torch.tensor(row, dtype=torch.float64)  # a NaN input must not read as a mismatch


def _positional_names(function) -> list[str]:
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _compare_across_ranks(tensors, rng_state, group) -> None:
    """One all-gather of the 5-number fingerprint; on a mismatch, name what differs and raise."""
    device = tensors[0][1].device if tensors else torch.device("cpu")
    mine = _fingerprint(tensors, rng_state).to(device)
    everyone = all_gather_stacked(mine, group).tolist()  # shared memory where the model's collectives use it
    bad = [r for r, other in enumerate(everyone) if other != everyone[0]]
    if bad:
        raise InputMismatchError(_mismatch_message(tensors, everyone, bad, group))


def input_check(model: nn.Module, group):
    """The input check: before every forward, one all-gather of a 5-number fingerprint of *every* tensor
    argument (and, in training mode, of the RNG state); on a mismatch, every rank (they all see it) joins
    one more gather to name the arguments that differ, and raises InputMismatchError.

    ``hook.paused`` skips it: `generate` checks its own arguments and the RNG state once per call, and
    every forward inside it then gets inputs derived identically on every rank (the gathered logits are
    the same bytes everywhere, sampling draws from the checked RNG state), so the decode steps need no
    gather of their own."""
    positional = _positional_names(model.forward)

    def hook(module, args, kwargs):
        # compiled: the fingerprint reads values into Python floats, a graph break each; compiled forwards
        # go unchecked (docs/training.md, "torch.compile")
        if hook.paused or torch.compiler.is_compiling():
            return
        _compare_across_ranks(_tensors(args, kwargs, positional), torch.get_rng_state() if module.training else None,
                              group)

    hook.paused = False
    return hook


def check_generate_arguments(model: nn.Module, group, forward_check=None) -> None:
    """Ranks calling generate with different settings (max_new_tokens, ...) would run different numbers
    of forwards and leave the others blocked in a collective: compare them once per call, up front, with
    the tensor arguments (the prompt) and the RNG state (sampling); the per-forward check (`forward_check`)
    is paused for the forwards generate runs."""
    generate = model.generate
    positional = _positional_names(generate)

    @functools.wraps(generate)
    def checked_generate(*args, **kwargs):
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        settings = {k: v for k, v in kwargs.items() if v is None or isinstance(v, (bool, int, float, str))}
        settings["generation_config"] = config.to_json_string(use_diff=False) if config is not None else ""
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, settings, group=group)
        differ = sorted(k for k in set().union(*gathered) if any(g.get(k) != gathered[0].get(k) for g in gathered))
        if differ:
            bad = [r for r, g in enumerate(gathered) if any(g.get(k) != gathered[0].get(k) for k in differ)]
            raise InputMismatchError(
                f"ranks {bad} called generate with other settings than rank 0: {', '.join(differ)} "
                f"({differ[0]} = {[g.get(differ[0]) for g in gathered]} per rank). Every rank must generate "
                "the same way, or the ranks run different numbers of forwards and block each other.")
        if forward_check is None or forward_check.paused:  # no input check, or generate called re-entrantly
            return generate(*args, **kwargs)
        sampling = kwargs.get("do_sample", getattr(config, "do_sample", False))
        _compare_across_ranks(_tensors(args, kwargs, positional), torch.get_rng_state() if sampling else None, group)
        forward_check.paused = True
        try:
            return generate(*args, **kwargs)
        finally:
            forward_check.paused = False

    model.generate = checked_generate


def _mismatch_message(tensors, everyone: list[torch.Tensor], bad: list[int], group) -> str:
    """Which arguments differ (a second, rare gather of per-argument summaries), and what to do."""
    summary = {n: (tuple(t.shape), str(t.dtype), _sums(t)) for n, t in tensors}
    gathered: list = [None] * len(everyone)
    dist.all_gather_object(gathered, summary, group=group)
    names = sorted(set().union(*gathered))
    differ = [n for n in names if any(g.get(n) != gathered[0].get(n) for g in gathered)]
    rng = any(e[4] != everyone[0][4] for e in everyone)
    what = ", ".join(differ) if differ else ("the RNG state (training mode, or sampling)" if rng else "tensor values")
    advice = ("seed every rank with the same torch.manual_seed before training or sampling (dropout masks and "
              "sampled tokens must match)"
              if rng and not differ else "give all ranks the same batch (same data order and seed)")
    return (f"the ranks of this tensor-parallel model got different inputs: ranks {bad} differ from rank 0 in "
            f"{what}. Every rank must call the model with the same tensors: {advice}.")
