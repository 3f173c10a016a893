"""MODELS.md: the table of shipped mappings, generated from what CI proves (never written by hand).

Each row lists exactly the checks `tests/test_mappings.py` runs for that mapping on real ranks
(forward at every verify world size > 1; per-shard gradients in fp32 and fp64 and greedy generate for
the first verify config at world sizes 2 and 4), so a row reads "proven" only because a CI case
proves it: a failing case fails CI, and `tests/test_catalog.py` fails when MODELS.md differs from
what this module renders from the mappings. The per-rank parameter share comes from the plan on the
meta device (deterministic, no run needed).

    tpmap models [-o MODELS.md]
"""
from __future__ import annotations

from dataclasses import dataclass

from tpmap.compat import PROVEN, TRANSFORMERS
from tpmap.engine import planner
from tpmap.language import source

GENERATES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "WithLMHead", "MTModel")  # Reformer, Marian


@dataclass
class Row:
    model_type: str
    classes: list[str]
    forward_tp_sizes: list[int]
    gradient_tp_sizes: list[int]
    fp32_only: bool  # fp64 gradients declared not checkable (not_checked: grad_fp64)
    generate_tp_sizes: list[int]
    features: list[str]
    share_at_4: float | None  # the share of the parameters one rank holds at tp_size 4
    notes: str


def proven_checks(mapping) -> tuple[list[int], list[int], list[int]]:
    """(forward, gradient, generate) world sizes, as tests/test_mappings.py parametrizes them."""
    forward = sorted({tp_size for spec in mapping.verify for tp_size in spec.world_sizes if tp_size > 1})
    first = mapping.verify[0]
    deep = [tp_size for tp_size in (2, 4) if tp_size in first.world_sizes]
    generates = any(c.endswith(GENERATES) for c in first.models) and "generate" not in first.not_checked
    generate = deep[:1] if generates else []  # with the fp32 gradients: at 2, or at 4 where 2 is not listed
    return forward, deep, generate


def features(mapping) -> list[str]:
    """The schema features a mapping uses, in the terms of docs/mapping-schema.md."""
    out: dict[str, None] = {}
    if mapping.compose:
        out["compose"] = None
    for e in mapping.entries:
        out[e.kind] = None
        for flag in ("reverse", "combined_qkv", "gather_output"):
            if getattr(e, flag, False):
                out[flag] = None
        if getattr(e, "copy_input", True) is False:
            out["copy_input: false"] = None
        if getattr(e, "sections", None) is not None:
            out["sections"] = None
        if getattr(e, "groups", None) is not None:
            out["groups"] = None
        if getattr(e, "partial", False):
            out["partial"] = None
        if e.when:
            out["when"] = None
    if mapping.uneven:
        out["uneven"] = None
    if mapping.vocab_parallel is not None:
        out["vocab_parallel"] = None
    if mapping.grad_allreduce:
        out["grad_allreduce"] = None
    if mapping.unsupported:
        out["unsupported"] = None
    order = ["Column", "Row", "Update", "Param", "Reduce", "Enter", "Input", "Norm"]
    kinds = [k for k in order if k in out]
    return kinds + [k for k in out if k not in order]


def share_at(mapping, loaded, tp_size: int = 4) -> float | None:
    """Parameters on one rank / parameters of the model, for the first verify config and class."""
    import torch
    import transformers
    from transformers import AutoConfig

    spec = next((s for s in mapping.verify if tp_size in s.world_sizes), None)
    if spec is None:
        return None
    config = AutoConfig.for_model(mapping.model_type, **spec.config)
    with torch.device("meta"):
        model = getattr(transformers, spec.models[0])(config)
    plan = planner.build_plan(model, loaded, tp_size)
    shards = plan.params
    local = full = 0
    for name, p in model.named_parameters():
        full += p.numel()
        local += torch.Size(shards[name].local_shape(0)).numel() if name in shards else p.numel()
    return local / full


def rows() -> list[Row]:

    out = []
    for model_type, path in source.shipped_files().items():
        loaded = source.read_file(path)
        mapping = loaded.mapping
        forward, gradient, generate = proven_checks(mapping)
        notes = []
        if mapping.kept_whole:
            notes.append("**partial**, kept whole: " + "; ".join(f"`{k.module}` ({k.reason})"
                                                                 for k in mapping.kept_whole))
        plain = [p for p in mapping.replicated if isinstance(p, str)]
        if plain:
            notes.append("replicated by design: " + ", ".join(f"`{p}`" for p in plain))
        for check, reason in mapping.verify[0].not_checked.items():
            notes.append(f"{check} not run ({reason})")
        notes += [f"unsupported: {u.reason}" for u in mapping.unsupported]
        if mapping.transformers:
            notes.append(f"needs transformers{mapping.transformers}")
        classes = list(dict.fromkeys(c for spec in mapping.verify for c in spec.models))
        out.append(Row(model_type, classes, forward, gradient, "grad_fp64" in mapping.verify[0].not_checked, generate,
                       features(mapping), share_at(mapping, loaded),
                       "; ".join(notes)))
    return out


def render(table: list[Row]) -> str:
    def sizes(values: list[int]) -> str:
        return ", ".join(map(str, values)) if values else "-"

    text, multimodal = auto_mapping_types()
    by_kind = {kind: [] for kind, _ in SECTIONS}
    for r in table:
        by_kind["text" if r.model_type in text else "multimodal" if r.model_type in multimodal else "part"].append(r)
    lines = [
        "# Models",
        "",
        "Generated by `tpmap models -o MODELS.md` from the shipped mappings; `tests/test_catalog.py` fails when",
        "this file differs. Every check listed runs in CI (`tests/test_mappings.py`) on real gloo ranks against",
        "the unsharded model built in the same run: *forward* = logits within 1e-5 relative at those world",
        "sizes; *gradients* = every rank's gradient equals its slice of the unsharded gradient (fp32 1e-4",
        "relative at the first size listed, fp64 1e-6 at the second; both where one is listed); *generate* = greedy",
        "tokens identical to the unsharded model on every rank.",
        "*Share* = parameters one rank holds at world size 4 / all parameters (first verify config).",
        "",
        f"Transformers versions proven: {' and '.join(PROVEN)}, the oldest and the newest release of the range "
        f"tpmap accepts (transformers{TRANSFORMERS}; `tpmap.compat`): CI runs every check below on {PROVEN[-1]} "
        f"and lints and verifies (forward, world size 2) every mapping on {PROVEN[0]}. A mapping with its "
        "own `transformers` range is checked only on the releases in it (its notes say so); one whose range "
        f"excludes {PROVEN[-1]} gets every check below on {PROVEN[0]}.",
        "",
        f"{len(table)} model types: {len(by_kind['text'])} of the {len(text)} text types of transformers "
        f"{PROVEN[-1]}'s causal-LM, seq2seq-LM and masked-LM auto mappings, {len(by_kind['multimodal'])} of the "
        f"{len(multimodal)} types its image-text-to-text mapping holds beyond those, and "
        f"{len(by_kind['part'])} towers and other sub-models that the others compose (vision and audio encoders),"
        " each verified on its own. Types without a mapping and why: [docs/refused.md](docs/refused.md).",
    ]
    # MODELS.md's column titles (tests/test_catalog.py pins the file): "ws" there is the tp_size
    header = ["| model type | classes | forward (ws) | gradients (ws) | generate (ws) | share at ws 4 | features "
              "| notes |", "|---|---|---|---|---|---|---|---|"]
    for kind, title in SECTIONS:
        lines += ["", f"## {title}", "", *header]
        for r in by_kind[kind]:
            share = f"{r.share_at_4:.1%}" if r.share_at_4 is not None else "-"
            gradients = sizes(r.gradient_tp_sizes) + (" (fp32 only)" if r.gradient_tp_sizes and r.fp32_only else "")
            lines.append(f"| `{r.model_type}` | {', '.join(r.classes)} | {sizes(r.forward_tp_sizes)} | {gradients} | "
                         f"{sizes(r.generate_tp_sizes)} | {share} | {', '.join(r.features)} | "
                         f"{r.notes.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


SECTIONS = (("text", "Text models"), ("multimodal", "Multimodal models"),
            ("part", "Towers and other sub-models"))


def auto_mapping_types() -> tuple[set[str], set[str]]:
    """The text model types of the installed transformers' causal-LM, seq2seq-LM and masked-LM auto mappings, and
    the types of its image-text-to-text mapping that are not among them."""
    from transformers.models.auto import modeling_auto as auto

    text = (set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
            | set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES))
    return text, set(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - text
