"""`tpmap verify`: prove a mapping by running it on real ranks against the unsharded model.

For every (model type, embedded tiny config, model class, world size) case, every rank builds the
same random model (fixed seed, large init), computes the unsharded output, applies the mapping to a
copy and compares. The reference is computed in the same run, never stored.

Tolerance: fp32, ``max|sharded - full| <= RTOL * max|full|`` with RTOL = 1e-5 (a verify config may declare
a looser `tolerance`, with its reason). Sharding only changes
the order of float additions (partial sums per rank, then an all-reduce), which costs a few ulps
(measured <= 2e-6 relative); a wrong head split or section order is off by 1e-1 or more.
"""
from __future__ import annotations

import copy
import inspect
import threading
import time
from dataclasses import dataclass

import torch

from tpmap.api import apply
from tpmap.engine.collectives import counting_collectives
from tpmap.language import expr
from tpmap.language.errors import ConfigAttributeError, DivisibilityError, MappingError, TpmapError
from tpmap.language.source import for_model_type, read_file
from tpmap.parallelize.rank_processes import RankFailure, RankPool
from tpmap.tool_errors import MissingInputError

RTOL = 1e-5
INIT_STD = 0.2  # a large init: with transformers' small default, a wrong head split hides at 1e-6


# -- building the embedded tiny models (used by verify, the tests and the benchmarks) ---------------
PLACEMENT = ":experts="  # a ref with a placement other than the mapping's default: "mixtral:experts=parallel"


def resolve(ref: str):
    """A MappingFile from a model type (shipped mapping) or a path to a YAML file, with the experts placement that
    a ``:experts=<placement>`` suffix names chosen."""
    from pathlib import Path

    from tpmap.prepare import choose_experts

    ref, _, experts = ref.partition(PLACEMENT)
    loaded = read_file(ref) if ref.endswith((".yaml", ".yml")) or Path(ref).is_file() else for_model_type(ref)
    return choose_experts(loaded, experts or None)


def tiny_config(ref: str, verify_index: int = 0):
    """The embedded tiny config number `verify_index` of a mapping (model type or YAML path)."""
    return _config_of(resolve(ref).mapping, verify_index)


def _config_of(mapping, verify_index: int):
    from transformers import AutoConfig

    return AutoConfig.for_model(mapping.model_type, **mapping.verify[verify_index].config)


def build_model(ref: str, verify_index: int, class_name: str, seed: int = 0, init_std: float = INIT_STD):
    """The tiny model, identical on every rank: fixed seed, large init, eval mode, fp32."""
    import transformers

    config = tiny_config(ref, verify_index)
    cls = getattr(transformers, class_name)
    torch.manual_seed(seed)
    model = cls(config)
    large_init_(model, seed, init_std)
    return model.eval()


@torch.no_grad()
def large_init_(model: torch.nn.Module, seed: int, std: float = INIT_STD) -> None:
    """Re-draw every parameter: matrices and biases ~ N(0, std^2), 1-D weights (norms) ~ 1 + N(0, std^2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
        base = 1.0 if (p.dim() == 1 and name.endswith("weight")) else 0.0
        p.copy_(noise + base)


def example_inputs(model, declared: dict | None = None, batch: int = 2, seq: int = 10, seed: int | None = None,
                   pad: int = 3, world_sizes=(2, 3, 4)) -> dict:
    """Example inputs for `model`, following its class, plus the `declared` ones (a verify config's
    ``inputs``: name -> `tpmap.language.schema.ExampleInput`), which add to or replace the derived ones by name.

    Derived: when the main input (``model.main_input_name``) is ``input_ids``, `batch` sequences of
    `seq` token ids in [3, vocab_size) and an ``attention_mask`` whose last row is right-padded by
    `pad` tokens; an encoder-decoder also gets ``decoder_input_ids`` (batch x seq // 2 + 1). Any other
    main input (Whisper's ``input_features``, ``pixel_values``) has a model-specific shape and must be
    declared, or `MissingInputError` is raised. Declared shapes are expressions over config attributes
    and ``batch`` / ``seq`` (a dotted name reads a sub-config: ``vision_config.image_size``); kinds: ``ids``
    (token ids), ``float`` (standard normal), ``mask`` (ones, last row right-padded by `pad`), ``values`` (the
    integer expressions `values` in every row: image sizes). Declared ids may
    hold ``tokens``: runs of one id (image placeholders), placed back to back from position 1 of every row,
    the id nowhere else (`place_runs`); a declared ``input_ids`` of the derived shape keeps the derived mask's
    padding in mind. Everything is drawn from one generator seeded with `seed`, by
    default a stable hash of the model type (`stable_seed`), so every mapping sees other ids.

    Token ids also hold the vocabulary-shard boundaries (`vocab_boundaries`: the first and last row of
    every rank's shard of the embedding reading them, at each of `world_sizes`, and V - 1), placed at
    random positions (unpadded ones first) of the drawn ids; ids below 3 and the config's special token
    ids are left out. Random ids alone rarely land on a boundary, where an off-by-one in a
    vocabulary-parallel lookup shows.
    """
    declared = declared or {}
    gen = torch.Generator().manual_seed(stable_seed(model.config.model_type) if seed is None else seed)
    ids = _IdDraw(model, gen, world_sizes)
    inputs = _derived_inputs(model, declared, ids, batch, seq, pad)
    lookup = _size_lookup(model.config, batch, seq)
    for name, spec in declared.items():  # in order: a declared input may replace a derived one (the mask)
        inputs[name] = _declared_input(name, spec, lookup, inputs, ids, gen, pad)
    return inputs


@dataclass(frozen=True)
class _IdDraw:
    """Token ids for one model, drawn from `gen` in [3, vocab_size), holding the vocabulary-shard boundaries
    (`boundary_ids`) and the declared runs of one id (`place_runs`)."""
    model: torch.nn.Module
    gen: torch.Generator
    world_sizes: tuple

    @property
    def vocab(self) -> int | None:
        """The vocabulary size (a multimodal config keeps it in its text_config)."""
        return getattr(self.model.config.get_text_config(), "vocab_size", None)

    def __call__(self, name: str, shape: tuple, mask: torch.Tensor | None = None, runs=()) -> torch.Tensor:
        out = torch.randint(3, self.vocab, shape, generator=self.gen)
        boundaries = boundary_ids(self.model, self.world_sizes, decoder=name.startswith("decoder_"))
        if not runs:
            return place_ids(out, boundaries, self.gen, mask)
        tokens = {t for t, _ in runs}
        keep = place_runs(out, runs, mask, spare_id(self.model.config, self.vocab, tokens), name)
        return place_ids(out, [b for b in boundaries if b not in tokens], self.gen, mask, keep)


def _derived_inputs(model, declared: dict, ids: _IdDraw, batch: int, seq: int, pad: int) -> dict:
    """The inputs that follow the model's class: `batch` x `seq` ``input_ids`` with their right-padded
    ``attention_mask``, and an encoder-decoder's ``decoder_input_ids``; a main input whose shape tpmap cannot
    derive, and not declared, raises `MissingInputError`."""
    main = getattr(model, "main_input_name", "input_ids")
    if main not in declared and main != "input_ids":
        raise MissingInputError(
            f"{type(model).__name__}'s main input is {main!r}, whose shape tpmap cannot derive; declare it in the "
            f"verify config, e.g. inputs: {{{main}: {{shape: [batch, ...], kind: float}}}}"
        )
    takes_ids = "input_ids" in inspect.signature(model.forward).parameters
    if main == "input_ids" and not takes_ids and not declared:
        raise MissingInputError(
            f"{type(model).__name__}.forward takes no input_ids (and names no other main input): declare the inputs "
            "it takes in the verify config, e.g. inputs: {pixel_values: {shape: [batch, ...], kind: float}}"
        )
    inputs = {}
    if main == "input_ids" and takes_ids:
        mask = _mask((batch, seq), pad)
        inputs["input_ids"] = ids("input_ids", (batch, seq), mask)
        inputs["attention_mask"] = mask
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids("decoder_input_ids", (batch, seq // 2 + 1))
    return inputs


def _size_lookup(config, batch: int, seq: int):
    """The names a declared input's expressions read: ``batch``, ``seq`` and config attributes (a dotted name
    reads a sub-config's)."""
    def lookup(name: str) -> int:
        sizes = {"batch": batch, "seq": seq}
        if name in sizes:
            return sizes[name]
        value = config
        for part in name.split("."):  # a dotted name: a sub-config's attribute
            if not hasattr(value, part):
                raise ConfigAttributeError(f"an example input names {name!r}, which the "
                                           f"{type(config).__name__} does not have")
            value = getattr(value, part)
        return value

    return lookup


def _declared_input(name: str, spec, lookup, inputs: dict, ids: _IdDraw, gen: torch.Generator,
                    pad: int) -> torch.Tensor:
    """One declared input (`tpmap.language.schema.ExampleInput`), by its kind; `inputs` are those made so far."""
    shape = tuple(expr.evaluate(dim, lookup) for dim in spec.shape)
    if spec.kind == "ids":
        derived = inputs.get("attention_mask") if name == "input_ids" else None
        mask = derived if derived is not None and tuple(derived.shape) == shape else None
        runs = [(expr.evaluate(t.id, lookup), expr.evaluate(t.count, lookup)) for t in spec.tokens]
        return ids(name, shape, mask, runs)
    if spec.kind == "float":
        return _floats(name, spec, shape, lookup, gen)
    if spec.kind == "values":
        row = [expr.evaluate(v, lookup) for v in spec.values]
        if shape[-1] != len(row):
            raise MissingInputError(f"{name}: {len(row)} values for a last dimension of {shape[-1]} "
                                    f"(shape {shape}); give one value per element")
        return torch.tensor(row, dtype=torch.long).expand(shape).clone()
    if spec.kind == "grid":
        width, height = (expr.evaluate(v, lookup) for v in spec.grid)
        if shape[-2:] != (width * height, 2):
            raise MissingInputError(f"{name}: a {width} x {height} grid has {width * height} cells of (x, y), "
                                    f"so its last two dimensions are [{width * height}, 2], not {list(shape[-2:])}")
        cell = torch.arange(width * height)
        return torch.stack([cell % width, cell // width], -1).expand(shape).clone()  # (..., W*H, 2)
    if spec.kind == "bool":
        return torch.ones(shape, dtype=torch.bool)
    return _mask(shape, pad)


def _floats(name: str, spec, shape: tuple, lookup, gen: torch.Generator) -> torch.Tensor:
    """Standard normal values; with a ``grid``, flattened patches led by their (row, column) on the grid,
    counted from 1."""
    out = torch.randn(shape, generator=gen)
    if not spec.grid:
        return out
    width, height = (expr.evaluate(v, lookup) for v in spec.grid)
    if len(shape) < 2 or shape[-2] != width * height or shape[-1] < 3:
        raise MissingInputError(
            f"{name}: a {width} x {height} grid has {width * height} patches, each led by its (row, "
            f"column), so its last two dimensions are [{width * height}, 2 + features], not "
            f"{list(shape[-2:])}")
    patch = torch.arange(width * height)
    out[..., 0] = (patch // width + 1).float()
    out[..., 1] = (patch % width + 1).float()
    return out


def stable_seed(name: str) -> int:
    """A seed from a name, the same in every process and run (Python's hash() of a str is salted)."""
    import zlib

    return zlib.crc32(name.encode())


def vocab_boundaries(vocab: int, world_sizes) -> list[int]:
    """The first and last row of every rank's shard of a `vocab`-row vocabulary at each world size, and
    vocab - 1: under the padded split, ceil(V / tp_size) rows per rank, rank r from row r * ceil(V / tp_size)."""
    out = {vocab - 1}
    for tp_size in world_sizes:
        per = -(-vocab // tp_size)
        for start in range(0, vocab, per):
            out |= {start, min(start + per, vocab) - 1}
    return sorted(out)


def boundary_ids(model, world_sizes=(2, 3, 4), decoder: bool = False) -> list[int]:
    """The vocabulary-shard boundaries (`vocab_boundaries`) of the embedding reading `model`'s input ids (its
    decoder's with `decoder`) at `world_sizes`, without ids below 3 and the config's special token ids."""
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    rows = embedding_rows(model, decoder=decoder, default=vocab)
    if rows is None:
        return []
    avoid = special_ids(model.config)
    return [i for i in vocab_boundaries(rows, world_sizes) if i >= 3 and i not in avoid]


def special_ids(config) -> set[int]:
    """Token ids a config names (pad, bos, eos, sep, mask, decoder start, ...), which models treat specially."""
    out: set[int] = set()
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        for key, value in cfg.to_dict().items():
            if key.endswith(("_token_id", "_token_ids", "_token_index")):
                out |= {v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)}
    return out


def embedding_rows(model, decoder: bool = False, default: int | None = None) -> int | None:
    """The rows of the embedding that reads a model's input ids (its decoder's with `decoder`): the
    vocabulary a vocabulary-parallel split divides; `default` when there is no such nn.Embedding."""
    try:
        owner = model.get_decoder() if decoder else model
        embedding = owner.get_input_embeddings() if hasattr(owner, "get_input_embeddings") else None
        embedding = embedding if embedding is not None else getattr(owner, "embed_tokens", None)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        embedding = None
    rows = getattr(embedding, "num_embeddings", None)
    return rows if isinstance(rows, int) else default


def place_ids(ids: torch.Tensor, values: list[int], gen: torch.Generator,
              mask: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """`ids` with `values` written at distinct random positions (where `mask` is 1 first, then where it is
    0), never where `keep` is true; as many as there are positions."""
    flat = ids.view(-1)
    order = torch.randperm(flat.numel(), generator=gen)
    if keep is not None:
        order = order[~keep.reshape(-1)[order]]
    if mask is not None:  # stable: unpadded positions first, each group in random order
        order = order[torch.argsort((mask.reshape(-1)[order] == 0).to(torch.int8), stable=True)]
    for position, value in zip(order.tolist(), values):
        flat[position] = value
    return ids


def place_runs(ids: torch.Tensor, runs: list[tuple[int, int]], mask: torch.Tensor | None, spare: int,
               name: str = "input_ids") -> torch.Tensor:
    """Write `runs` ((token id, count) pairs) into every row of `ids` (last dim: positions), back to back from
    position 1, in place; the ids drawn elsewhere that equal a run's token become `spare`. Returns where the
    runs are (a bool tensor like `ids`). Every row's unpadded part (`mask`) must hold them."""
    total = sum(n for _, n in runs)
    room = ids.shape[-1] - 1
    if mask is not None:
        room = min(room, int(mask.sum(-1).min()) - 1)
    if total > room or any(n < 0 for _, n in runs):
        raise MissingInputError(f"{name}: the token runs {runs} need {total} positions after the first of every "
                                f"row, but rows of {tuple(ids.shape)} leave {room} (unpadded); shrink the count "
                                "(a smaller image) or lengthen the input")
    for token, _ in runs:
        ids[ids == token] = spare
    keep = torch.zeros(ids.shape, dtype=torch.bool)
    at = 1
    for token, n in runs:
        ids[..., at:at + n] = token
        keep[..., at:at + n] = True
        at += n
    return keep


def spare_id(config, vocab: int, avoid: set[int]) -> int:
    """The smallest id >= 3 that no config names as special and that is not in `avoid`."""
    taken = special_ids(config) | avoid
    return next(i for i in range(3, vocab) if i not in taken)


def _mask(shape: tuple, pad: int) -> torch.Tensor:
    """Ones; the last row's last `pad` positions 0 (right padding), when there is more than one row."""
    mask = torch.ones(shape, dtype=torch.long)
    if shape[0] > 1 and pad:
        mask[-1, ..., shape[-1] - pad:] = 0
    return mask


def case_inputs(ref: str, verify_index: int, model) -> dict:
    """The example inputs of verify config `verify_index` of a mapping for `model` (one of its classes),
    seeded by the mapping's model type and config name, with the vocabulary-shard boundary ids of every
    world size the mapping verifies.

    A model whose inputs cannot be made raises a `MappingError` located at that verify config."""
    loaded = resolve(ref)
    spec = loaded.mapping.verify[verify_index]
    world_sizes = sorted({tp_size for v in loaded.mapping.verify for tp_size in v.world_sizes if tp_size > 1})
    try:  # a seed of its own per mapping and config; the shard boundaries of every world size it verifies
        return example_inputs(model, spec.inputs, seed=stable_seed(f"{loaded.mapping.model_type}/{spec.name}"),
                              world_sizes=world_sizes)
    except TpmapError as e:  # an undeclared main input, a shape naming no config attribute or not dividing
        rule = {MissingInputError: "missing-key", DivisibilityError: "divisibility"}.get(type(e), "config-attribute")
        raise MappingError(f"verify config {spec.name!r}: {e}", loaded.source.value(("verify", verify_index)),
                           rule) from None


def main_output(out) -> torch.Tensor:
    """The tensor to compare: logits when the model has a head, else the last hidden state."""
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None)
        if value is not None:
            return value
    raise AssertionError(f"no logits or last_hidden_state in {type(out).__name__}")


# -- the case that runs on every rank ------------------------------------------------------------
def forward_case(ref: str, verify_index: int, class_name: str) -> dict:
    """Runs on each rank: full vs sharded forward. Returns numbers for the report."""
    import torch.distributed as dist

    tp_size = dist.get_world_size() if dist.is_initialized() else 1
    loaded = resolve(ref)
    full = build_model(ref, verify_index, class_name)
    inputs = case_inputs(ref, verify_index, full)
    with torch.no_grad():
        reference = main_output(full(**inputs))

    sharded = apply(copy.deepcopy(full), tp_size, mapping=loaded)
    with torch.no_grad(), counting_collectives() as comm:
        got = main_output(sharded(**inputs))
    plan = getattr(sharded, "tpmap_plan", None)
    bad_fraction = []  # each split parameter holds 1/tp_size of the original (ceil(V/tp_size) rows when padded)
    if plan is not None:
        local = dict(sharded.named_parameters(remove_duplicate=False))
        local |= dict(sharded.named_buffers(remove_duplicate=False))  # a Param entry may split a buffer
        uneven = set(plan.uneven)
        for shard in plan.params.values():
            if shard.dim is None or shard.replicated_heads or {shard.name, shard.name.rpartition(".")[0]} & uneven:
                continue  # (an uneven split of a module or a Param tensor: ranks hold different counts, checked
                # by the plan itself)
            dim = shard.full_shape[shard.dim]
            per_rank = -(-dim // tp_size) if shard.local_size else dim // tp_size
            want = torch.Size(shard.full_shape).numel() // dim * per_rank
            if local[shard.name].numel() != want or (not shard.local_size and dim % tp_size):
                bad_fraction.append(f"{shard.name}: {local[shard.name].numel()} elements, expected {want}")
    return {
        "max_diff": (got - reference).abs().max().item() if got.shape == reference.shape else float("inf"),
        "scale": reference.abs().max().item(),
        "shape_ok": tuple(got.shape) == tuple(reference.shape),
        "params_local": sum(p.numel() for p in sharded.parameters()),
        "params_full": sum(p.numel() for p in full.parameters()),
        "bad_fraction": bad_fraction,
        "collectives": dict(comm),  # per forward, the input check's fingerprint all-gather included
    }


# -- the driver ----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Case:
    ref: str  # model type or mapping file
    model_type: str
    verify_index: int
    config_name: str
    class_name: str
    world_size: int


@dataclass(kw_only=True)
class Result:
    case: Case
    passed: bool
    max_diff: float | None = None
    rel_diff: float | None = None
    params_local: int | None = None
    params_full: int | None = None
    error: str = ""
    collectives: dict | None = None


def cases(refs, world_sizes=None) -> list[Case]:
    """Every (config, class, world size) case of the mappings `refs` (model types or YAML paths)."""
    out = []
    for ref in refs:
        loaded = resolve(ref)
        mapping = loaded.mapping
        others = {i: other_placements(ref, i, loaded) for i in range(len(mapping.verify))}
        for placement in [None] + sorted(set().union(*others.values())):
            placed, suffix = (ref, "") if placement is None else (f"{ref}{PLACEMENT}{placement}", f" [{placement}]")
            for i, spec in enumerate(mapping.verify):
                if placement is not None and placement not in others[i]:
                    continue  # a composing mapping whose parts place experts in this config's model only
                for tp_size in spec.world_sizes:
                    if world_sizes and tp_size not in world_sizes:
                        continue
                    out.extend(Case(ref=placed, model_type=mapping.model_type, verify_index=i,
                                    config_name=spec.name + suffix, class_name=cls, world_size=tp_size)
                               for cls in spec.models)
    return out


def other_placements(ref: str, verify_index: int, loaded=None) -> list[str]:
    """The experts placements other than the default that verify config `verify_index` offers: the mapping's own
    entries', and for a mapping that composes others its parts' too, read with the config (a vision-language model
    whose language model places experts both ways). A composing mapping whose `transformers` range excludes the
    installed release offers its own entries' only: its config may not exist there (its cases are skipped).
    `loaded`: `resolve(ref)`, where the caller holds it already."""
    from tpmap.compat import mapping_applies
    from tpmap.language import compose

    loaded = loaded or resolve(ref)
    if loaded.mapping.compose and mapping_applies(loaded.mapping.transformers):
        default, offered = compose.placements(loaded, _config_of(loaded.mapping, verify_index))
    else:
        default, offered = loaded.mapping.experts, {e.experts for e in loaded.mapping.entries if e.experts}
    return sorted(offered - {default})


def judge(case: Case, per_rank: list[dict]) -> Result:
    worst = max(r["max_diff"] for r in per_rank)
    scale = max(r["scale"] for r in per_rank)
    rel = worst / max(scale, 1e-30)
    problems = [p for r in per_rank for p in r["bad_fraction"]]
    if not all(r["shape_ok"] for r in per_rank):
        problems.append("output shape differs from the unsharded model")
    if not rel <= RTOL:  # also catches NaN; only then is the mapping read again, for the config's own bound
        tolerance = resolve(case.ref).mapping.verify[case.verify_index].tolerance
        rtol = tolerance.forward if tolerance is not None else RTOL  # a declared bound is > RTOL (schema)
        if not rel <= rtol:
            problems.append(f"max|diff| {worst:.3g} is {rel:.3g} of max|output| {scale:.3g} (> {rtol:g})")
    return Result(case=case, passed=not problems, max_diff=worst, rel_diff=rel,
                  params_local=per_rank[0]["params_local"], params_full=per_rank[0]["params_full"],
                  error="; ".join(problems),
                  collectives=per_rank[0].get("collectives"))


def run(case_list: list[Case], timeout: float = 300.0, log=print, verbose: bool = False, jobs: int = 1) -> list[Result]:
    """Run the cases, in order of world size: each of `jobs` workers (threads) takes the next case and runs it on
    its own RankPool of that world size (world size 1 in this process, or in a pool too when `jobs` > 1). A failing
    case reports one line per rank (its exception); `verbose` gives every rank's whole traceback. Each row ends with
    the progress: cases done of the total, the time so far and an estimate of the time left. The results come back
    in `case_list`'s order."""
    todo = sorted(range(len(case_list)), key=lambda i: case_list[i].world_size)
    results: dict[int, Result] = {}
    lock = threading.Lock()
    widths = Widths.of(case_list)
    start = time.monotonic()

    def worker() -> None:
        pool = None
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    i = todo.pop(0)
                case = case_list[i]
                if pool is not None and pool.world_size != case.world_size:
                    pool.close()  # cases come in order of world size: this worker's smaller pool is done
                    pool = None
                if pool is None and (case.world_size > 1 or jobs > 1):  # in parallel, world size 1 in a process too
                    pool = RankPool(case.world_size)
                t0 = time.monotonic()
                res = _run_case(case, pool, timeout, verbose)
                with lock:
                    results[i] = res
                    now = time.monotonic()
                    log(_row(res, now - t0, widths, progress(len(results), len(case_list), now - start)))
        finally:
            if pool is not None:
                pool.close()
    threads = [threading.Thread(target=worker, name=f"tpmap-verify-{j}") for j in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(case_list))]


def _run_case(case: Case, pool: RankPool | None, timeout: float, verbose: bool) -> Result:
    args = (case.ref, case.verify_index, case.class_name)
    try:
        per_rank = pool.run(forward_case, *args, timeout=timeout) if pool else [forward_case(*args)]
        return judge(case, per_rank)
    except RankFailure as e:
        return Result(case=case, passed=False, error=str(e) if verbose else e.summary())
    except Exception as e:  # world size 1 runs here: report it like a rank failure
        return Result(case=case, passed=False, error=f"{type(e).__name__}: {e}")


def progress(done: int, total: int, elapsed: float) -> str:
    """'[12/2236 0:41 eta 2:07:03]': cases done of the total, the time so far, the time left at the mean pace."""
    def clock(seconds: float) -> str:
        minutes, sec = divmod(int(seconds), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02}:{sec:02}" if hours else f"{minutes}:{sec:02}"
    left = elapsed / done * (total - done) if done else 0.0
    return f"[{done}/{total} {clock(elapsed)} eta {clock(left)}]"


@dataclass(frozen=True)
class Widths:
    """The widths of the table's name columns: the longest model type, config and class among the cases (at least
    the header's), so that every row lines up whatever the names."""
    model_type: int = 12
    config: int = 9
    cls: int = 32

    @classmethod
    def of(cls, case_list) -> Widths:
        return cls(max([12] + [len(c.model_type) for c in case_list]),
                   max([9] + [len(c.config_name) for c in case_list]),
                   max([32] + [len(c.class_name) for c in case_list]))

    def names(self, model_type: str, config: str, class_name: str) -> str:
        return f"{model_type:<{self.model_type}} {config:<{self.config}} {class_name:<{self.cls}}"


def header(case_list=()) -> str:
    """The table's header line, its name columns as wide as `case_list`'s names (`Widths`)."""
    return (f"{Widths.of(case_list).names('model_type', 'config', 'class')} {'tp_size':>7} {'max|diff|':>10} "
            f"{'rel':>9} {'params/rank':>12} {'of full':>8} {'comm/fwd':>9}  result")


HEADER = header()  # with the default widths


def comm_summary(counts: dict | None) -> str:
    """'12ar+2ag' for 12 all-reduces and 2 all-gathers in one forward ('-' without a process group)."""
    short = {"all_reduce": "ar", "all_gather": "ag", "all_gather_into_tensor": "ag", "reduce_scatter_tensor": "rs",
             "broadcast": "bc"}
    if not counts:
        return "-"
    merged = dict.fromkeys(dict.fromkeys(short.values()), 0)  # fixed order: ar, ag, rs, bc
    for name, n in counts.items():
        merged[short[name]] += n
    return "+".join(f"{n}{k}" for k, n in merged.items() if n)


def _row(r: Result, seconds: float, widths: Widths = Widths(), progress: str = "") -> str:
    c = r.case
    names = widths.names(c.model_type, c.config_name, c.class_name)
    if r.max_diff is None:
        return (f"{names} {c.world_size:>7} {'-':>10} {'-':>9} {'-':>12} {'-':>8} {'-':>9}  FAIL {progress}\n"
                f"{r.error}")
    frac = r.params_local / r.params_full
    line = (f"{names} {c.world_size:>7} {r.max_diff:>10.2e} {r.rel_diff:>9.1e} {r.params_local:>12,} {frac:>8.1%} "
            f"{comm_summary(r.collectives):>9}  {'pass' if r.passed else 'FAIL'} ({seconds:.1f}s) {progress}")
    return line.rstrip() + (f"\n    {r.error}" if r.error else "")
