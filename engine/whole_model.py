"""The whole-model features of a mapping, planned after its entries (`engine.planner.build_plan`): the
vocabulary split of the input embedding and the LM head (``vocab_parallel``), the parameters kept whole
whose gradients are summed over the ranks (``grad_allreduce``), and the check that no parameter is tied
across a split and a whole module. Each reads `owner` (full tensor name -> index of the entry that splits
it) to refuse a tensor the entries split already.
"""
from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from tpmap.engine import pieces as split
from tpmap.engine.errors import ModuleKindError
from tpmap.engine.layers import lookup_bypass
from tpmap.engine.plan import ModuleShard, ParamLayout
from tpmap.language.errors import PatternMatchError, TpmapError
from tpmap.language.patterns import match_modules, suggest_module
from tpmap.language.schema import release_matches
from tpmap.language.source import MappingFile


def names_by_parameter(model: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in the model (tied parameters have several)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return by_id


# -- vocab_parallel -----------------------------------------------------------------------------------------
def plan_vocab_parallel(model: nn.Module, loaded: MappingFile, tp_size: int,
                        owner: dict[str, int]) -> list[ModuleShard]:
    """ModuleShards for the input embedding (and every nn.Embedding sharing its weight) and the LM head."""
    spec, source = loaded.mapping.vocab_parallel, loaded.source
    pos = source.value(("vocab_parallel",))
    by_id = names_by_parameter(model)
    named = dict(model.named_modules())
    emb, head = _vocab_modules(model, spec, pos)
    _check_tied_halves(spec, emb, head, by_id, named, source)
    vocab = emb.weight.shape[0] if emb is not None else (head.weight.shape[0] if head is not None else None)
    if vocab is None:
        return []
    pieces, per_rank = split.vocab_pieces(vocab, tp_size)

    def shard_of(param) -> ParamLayout:
        names = by_id[id(param)]
        for n in names:
            if n in owner:
                raise PatternMatchError(f"{n} is in the vocabulary split and also claimed by entry "
                                        f"{owner[n]}", pos, "double-match")
        return ParamLayout(name=names[0], full_shape=tuple(param.shape), dim=0, pieces=pieces,
                           local_size=per_rank, aliases=tuple(names[1:]))

    shards = []
    if emb is not None:
        shards += _embedding_shards(named, emb, shard_of(emb.weight), pos)
    if head is not None:
        if head.weight.shape[0] != vocab:
            raise ModuleKindError(f"the LM head has {head.weight.shape[0]} rows but the embedding {vocab}; set "
                                  "lm_head: false", pos, "module-kind")
        name = next(n for n, m in named.items() if m is head)
        weight = shard_of(head.weight)
        bias = shard_of(head.bias) if head.bias is not None else None
        shards.append(ModuleShard(name=name, style="vocab_head", module_class=type(head).__name__, reverse=False,
                                  gather_output=True, entry=-1, weight=weight, bias=bias))
    return shards


def _vocab_modules(model: nn.Module, spec, pos) -> tuple[nn.Embedding | None, nn.Linear | None]:
    """(the input embedding, the LM head) that `spec` splits, each None where it keeps it whole."""
    emb = model.get_input_embeddings() if spec.embedding else None
    head = model.get_output_embeddings() if spec.lm_head else None
    if spec.embedding and not isinstance(emb, nn.Embedding):
        raise ModuleKindError(f"vocab_parallel.embedding: {type(model).__name__}.get_input_embeddings() is "
                              f"{type(emb).__name__}, not an nn.Embedding; set embedding: false", pos,
                              "module-kind")
    if head is not None and not isinstance(head, nn.Linear):
        raise ModuleKindError(f"vocab_parallel.lm_head: the output embedding is a {type(head).__name__}, not an "
                              "nn.Linear; set lm_head: false", pos, "module-kind")
    return emb, head


def _check_tied_halves(spec, emb, head, by_id: dict, named: dict, source) -> None:
    """One half of a tied pair split alone would leave the other half holding the shard (a whole LM head
    with a vocabulary slice for a weight: wrong-sized logits; a plain lookup into a slice: IndexError).
    Every holder of a split weight must be a module this split replaces."""
    replaced = {n for n, m in named.items()
                if m is head or (emb is not None and isinstance(m, nn.Embedding) and m.weight is emb.weight)}
    for module in (m for m in (emb, head) if m is not None):
        holders = {n.rpartition(".")[0] for n in by_id[id(module.weight)]}
        whole = sorted(holders - replaced)
        if whole:
            half, other = ("embedding", "lm_head") if module is emb else ("lm_head", "embedding")
            mine = next(n for n, m in named.items() if m is module)
            message = (f"vocab_parallel.{half} splits {mine}.weight along the vocabulary, but it is "
                       f"tied to {', '.join(n + '.weight' for n in whole)}, which stays whole"
                       + (f" (vocab_parallel.{other}: false)" if not getattr(spec, other) else "")
                       + "; set both embedding and lm_head to true, or untie them (tie_word_embeddings: false)")
            raise PatternMatchError(message, source.key(("vocab_parallel",)), "tied-parameter")


def _embedding_shards(named: dict, emb: nn.Embedding, weight: ParamLayout, pos) -> list[ModuleShard]:
    """A vocab_embedding ModuleShard for every nn.Embedding holding the input embedding's weight."""
    shards = []
    for name, module in named.items():
        if isinstance(module, nn.Embedding) and module.weight is emb.weight:
            bypass = lookup_bypass(type(module))  # the same rule the engine's class swap relies on
            if bypass is not None:
                raise ModuleKindError(
                    f"vocab_parallel.embedding: {name} is a {type(module).__name__} whose {bypass} does not "
                    "call super().forward, so a vocabulary-split lookup cannot run under it (it would index "
                    "the shard with full-vocabulary ids); set vocab_parallel.embedding: false to keep it "
                    "whole (and lm_head: false if the LM head is tied to it)", pos, "module-kind")
            shards.append(ModuleShard(name=name, style="vocab_embedding", module_class=type(module).__name__,
                                      reverse=False, gather_output=False, entry=-1, weight=weight, bias=None))
    return shards


# -- grad_allreduce -----------------------------------------------------------------------------------------
def plan_grad_allreduce(loaded: MappingFile, modules: dict[str, nn.Module], prefix: str,
                        owner: dict[str, int]) -> list[str]:
    """The full names of the parameters kept whole whose gradients are summed over the ranks. `modules`
    are the base model's by name, `prefix` the base model's name and a dot."""
    source, names = loaded.source, list(modules)
    grad_allreduce = []
    for i, item in enumerate(loaded.mapping.grad_allreduce):
        if not isinstance(item, str) and not release_matches(item.transformers):
            continue
        pattern = item if isinstance(item, str) else item.module
        hits = match_modules(pattern, names)
        if not hits:
            raise PatternMatchError(f"grad_allreduce pattern {pattern!r} matches no module"
                                    f"{suggest_module(pattern, names)}",
                                    source.value(("grad_allreduce", i)), "pattern-no-match")
        for rel in hits:
            own = dict(modules[rel].named_parameters(recurse=False))
            for pname in [] if isinstance(item, str) else item.params:
                if pname not in own:
                    raise PatternMatchError(
                        f"grad_allreduce: {prefix}{rel} ({type(modules[rel]).__name__}) holds no "
                        f"parameter {pname!r} itself; its own parameters: {', '.join(own) or 'none'}",
                        source.value(("grad_allreduce", i, "params")), "pattern-no-match")
            params = modules[rel].named_parameters() if isinstance(item, str) else (
                (pname, own[pname]) for pname in item.params)
            for pname, _ in params:
                full = f"{prefix}{rel}.{pname}"
                if full in owner:
                    raise PatternMatchError(f"{full} is sharded by entry {owner[full]}; grad_allreduce is "
                                            "for parameters kept whole", source.value(("grad_allreduce",)),
                                            "double-match")
                grad_allreduce.append(full)
    return grad_allreduce


# -- tied parameters ----------------------------------------------------------------------------------------
def tie_errors(model: nn.Module, loaded: MappingFile, shards: list[ModuleShard], tensors: list[ParamLayout],
               owner: dict[str, int]) -> Iterator[TpmapError]:
    """A sharded parameter must not also be used, tied, by a module that stays whole: an error per tie."""
    sharded = {t for m in shards for t in (m.weight and m.weight.name, m.bias and m.bias.name) if t}
    sharded |= {t.name for t in tensors}
    for names in names_by_parameter(model).values():
        if len(names) > 1 and any(n in sharded for n in names) and not all(n in sharded for n in names):
            entry = next(owner[n] for n in names if n in owner)
            yield PatternMatchError(
                f"{loaded.label(entry)}: parameter {names[0]} is tied to {', '.join(names[1:])}; "
                "shard all of them with the same entry or none",
                loaded.source.value(("entries", entry, "module")), "tied-parameter")
