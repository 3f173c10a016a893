"""`tpmap draft MODEL_TYPE`: a starting mapping for a model type, written from a tiny model's structure.

The draft is a start, never a proof: `tpmap verify` proves it. How it is made, top to bottom:

1. A tiny config (`tiny_model`): the model type's default config with its sizes cut down by key name
   (hidden 96, 12 heads, 4 KV heads where the config has them, head_dim 8, intermediate 192, 2 layers,
   vocabulary 256, 64 positions). It becomes the draft's `verify` config.
2. The most useful class (`model_class`: seq2seq LM for encoder-decoders, masked LM, causal LM, base
   model, from transformers' auto mappings), built on the meta device: shapes only, no weights.
3. The repeated blocks (the elements of the outermost ModuleLists, as `tpmap lint` defines them) and
   their weights (nn.Linear, Conv1D, nn.Embedding), paired per block (`analyse_block`):

   * attention: the q/k/v projections by name (`Q_NAMES`, ...; fused: `QKV_NAMES`) that share a
     parent, with the nearest other weight that maps the q width back to the stream width (the Row);
   * MLPs, by shapes: a Row writes the stream (out = hidden) from an inner width; its Columns are the
     nearest weights that read the stream and produce that inner width (or twice it: a fused
     [gate | up], flagged TODO). Registration order does not matter; scopes (parent modules) do;
   * an nn.Embedding as wide as the head count (a relative position bias) is a Column by heads;
     everything else stays whole (`replicated:`, with a TODO).

4. Where the config class ships a `base_model_tp_plan`, it decides how the modules it names are split
   (`translate_plan`); groups it does not name at all come from the analysis, with a note.
5. Updates (`update_entries`): int attributes of each split group's modules whose names speak of sizes
   and whose value is one the group divides (heads, KV heads, groups, widths) become per-rank
   expressions, and head counts read as `self.config.X` in a forward become `config.X` updates. Each
   expression is checked against the default config's model too (it must give the full value there).
6. `vocab_parallel` from `get_input_embeddings()` / `get_output_embeddings()`; `world_sizes` where the
   engine's planner accepts the draft (default config) and the verify config's (tiny config).

Fused weights whose layout shapes cannot tell ([q|k|v] blocks or head-major; [gate|up] halves or
interleaved) carry a `# TODO` comment: nothing is guessed silently. No model names appear here,
only tables of projection, attribute and config key names.
"""
from __future__ import annotations

import transformers

from tpmap.draft.analysis import blocks_of
from tpmap.draft.config import default_model, shipped_patch, tiny_model
from tpmap.draft.entries import (
    analysis_entries,
    groups_split,
    outside_head_embeddings,
    place_updates,
    supported_world_sizes,
    translate_plan,
    update_entries,
    vocab_parallel,
)
from tpmap.draft.names import TINY, WORLD_SIZES
from tpmap.draft.render import Draft
from tpmap.tool_errors import DraftError


def draft(model_type: str) -> str:
    """The draft mapping of `model_type` as YAML text; it loads with `tpmap.language.source.load_text`.
    Raises DraftError when no draft can be made (the config or model does not build, no pairs)."""
    patch = shipped_patch(model_type)
    config, overrides, notes, cls, model = tiny_model(model_type, patch)
    default, default_note = default_model(model_type, cls, patch)
    blocks = blocks_of(model.base_model)
    if not blocks:
        raise DraftError(f"{cls.__name__} has no repeated blocks (no nn.ModuleList of layers): nothing to pair")
    stream = getattr(config, "hidden_size", None) or TINY["hidden"]
    names = [n for n, _ in model.base_model.named_modules() if n]
    entries, groups = analysis_entries(blocks, stream, config, names)
    entries += outside_head_embeddings(model.base_model, blocks, config)
    tp_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    grad_allreduce: list[str] = []
    if tp_plan:
        entries, grad_allreduce, plan_notes = translate_plan(tp_plan, entries, model.base_model)
        notes += plan_notes
    updates, update_notes = update_entries(groups_split(groups, entries), config, stream,
                                           [model] + ([default] if default is not None else []))
    split = place_updates([e for e in entries if e.kind != "whole"], updates)
    if not split:
        raise DraftError(f"found no Column/Row pair in the blocks of {cls.__name__} (weights: "
                         f"{', '.join(e.module for e in entries) or 'none'}): write the mapping by hand")
    vocab, vocab_notes = vocab_parallel(model)
    source = ("its base_model_tp_plan (which decides how the modules it names are split) and the module structure"
              if tp_plan else "the module structure")
    header = [f"Draft by `tpmap draft {model_type}` (transformers {transformers.__version__}): from {source} of "
              f"{cls.__name__}, built on the meta device from the tiny config under verify. A start, not a proof: "
              "resolve the TODOs, then `tpmap lint FILE` and `tpmap verify FILE`."]
    d = Draft(model_type=model_type, model_class=cls.__name__, config=overrides, entries=split,
              whole=[e for e in entries if e.kind == "whole"], grad_allreduce=grad_allreduce, vocab_parallel=vocab,
              header=header, notes=notes + update_notes + vocab_notes, default_config=patch)
    d.verify_world_sizes = supported_world_sizes(model, d.load(), [1, 2, 3, 4]) or [1]
    d.world_sizes = supported_world_sizes(default, d.load(), WORLD_SIZES) if default is not None else []
    if not d.world_sizes:
        d.world_sizes = d.verify_world_sizes
        d.notes.append("TODO: world_sizes are the tiny config's: " + (
            default_note or "the planner accepts no world size on the default config"))
    d.load()
    return d.render()
