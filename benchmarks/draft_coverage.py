"""How many `tpmap draft` outputs verify unedited: ``python benchmarks/draft_coverage.py [MODEL_TYPE ...]``.

Drafts every model type that ships a mapping (``mappings/*.yaml``: the 120 text architectures; or, with
``--auto``, every model type of transformers' causal-LM, seq2seq-LM and masked-LM auto mappings; or the
model types given), loads each draft, and runs `tpmap verify`'s forward case on it at world size 2 (``-n``)
on one pool of real gloo ranks, each model under a time limit (``--timeout``). Prints one line per
model type and the count, and with ``--out FILE`` writes the same as a Markdown table. Slow on 2
cores (about 2-3 s per model once the ranks are up). A draft that cannot be made, a model that does
not build or a rank that fails is reported with its error, never skipped.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

MAX_PARAMETERS = 50_000_000  # per verify model: it is built on every rank and once more on failure

AUTO_MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
                 "MODEL_FOR_MASKED_LM_MAPPING_NAMES")


def shipped_model_types() -> list[str]:
    """The model types that ship a mapping (the file stem is the model_type), sorted."""
    import importlib.resources

    folder = importlib.resources.files("tpmap.mappings")
    return sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.name.endswith(".yaml"))


def auto_model_types() -> list[str]:
    """Every model type of transformers' causal-LM, seq2seq-LM and masked-LM auto mappings, sorted: the
    text models a draft is for (shipped or not; vision towers such as vit are not among them)."""
    from transformers.models.auto import modeling_auto

    return sorted({t for name in AUTO_MAPPINGS for t in getattr(modeling_auto, name)})


def one(model_type: str, folder: Path, pool, world_size: int, timeout: float) -> tuple[str, str]:
    """(status, detail): 'verified', 'fails verify', 'does not load' or 'no draft' (with the drafter's error,
    also when it crashed rather than refused)."""
    from tpmap import draft, verify
    from tpmap.language import source
    from tpmap.language.errors import TpmapError
    from tpmap.parallelize.rank_processes import RankFailure

    try:
        text = draft.draft(model_type)
    except TpmapError as e:
        return "no draft", str(e).splitlines()[0]
    except Exception as e:  # the drafter itself failed (a transformers surprise or a tpmap bug): shown as such
        return "no draft", f"drafter crashed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    path = folder / f"{model_type}.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        mapping = source.read_file(path).mapping
    except TpmapError as e:
        return "does not load", str(e).splitlines()[0]
    spec = mapping.verify[0]
    try:
        size = verify_parameters(mapping)
    except Exception as e:  # the verify model does not build: that is the result
        return "fails verify", f"the verify model does not build: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if size > MAX_PARAMETERS:  # a draft that kept default widths: too large to build on every rank here
        return "fails verify", f"the verify config builds {size:,} parameters, more than {MAX_PARAMETERS:,}: not run"
    if world_size not in spec.world_sizes:
        return "fails verify", f"the draft's verify world sizes {spec.world_sizes} lack {world_size}"
    case = verify.Case(ref=str(path), model_type=model_type, verify_index=0, config_name=spec.name,
                       class_name=spec.models[0], world_size=world_size)
    try:
        result = verify.judge(case, pool.run(verify.forward_case, case.ref, 0, case.class_name, timeout=timeout))
    except RankFailure as e:
        last = e.summary().splitlines()
        return "fails verify", unsharded_problem(case) + (last[1].strip() if len(last) > 1 else last[0])
    return ("verified", f"rel {result.rel_diff:.1e}") if result.passed else ("fails verify", result.error)


def verify_parameters(mapping) -> int:
    """Parameters of the draft's first verify model, counted on the meta device (no memory)."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(mapping.model_type, **mapping.verify[0].config)
    with torch.device("meta"):
        model = getattr(transformers, mapping.verify[0].models[0])(config)
    return sum(p.numel() for p in model.parameters())


def unsharded_problem(case) -> str:
    """'the unsharded tiny model fails too: ...; ' when the draft's verify config cannot even run the model
    (a tiny-config problem, not a sharding one), else ''."""
    from tpmap import verify

    try:
        model = verify.build_model(case.ref, 0, case.class_name)
        model(**verify.case_inputs(case.ref, 0, model))
    except Exception as e:  # what the model raises is the finding: reported
        return f"the unsharded tiny model fails too ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_types", nargs="*", help="default: every model type with a shipped mapping")
    parser.add_argument("--auto", action="store_true", help="every model type of transformers' causal-LM, "
                        "seq2seq-LM and masked-LM auto mappings instead of the shipped ones")
    parser.add_argument("-n", "--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model type on the ranks")
    parser.add_argument("--out", type=Path, help="also write the results as a Markdown table here")
    args = parser.parse_args(argv)

    from tpmap.parallelize.rank_processes import RankPool

    types = args.model_types or (auto_model_types() if args.auto else shipped_model_types())
    rows = []
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, RankPool(args.world_size) as pool:
        for model_type in types:
            t0 = time.monotonic()
            status, detail = one(model_type, Path(tmp), pool, args.world_size, args.timeout)
            rows.append((model_type, status, detail, time.monotonic() - t0))
            print(f"{model_type:<22} {status:<14} {rows[-1][3]:6.1f}s  {detail[:200]}", flush=True)
    counts = collections.Counter(status for _, status, _, _ in rows)
    summary = (f"{counts['verified']} of {len(rows)} drafts verify unedited at world size {args.world_size} "
               f"({counts['fails verify']} fail verify, {counts['does not load']} do not load, "
               f"{counts['no draft']} without a draft); {time.monotonic() - t_start:.0f} s")
    print(summary)
    if args.out:
        import transformers

        lines = [f"# tpmap draft coverage (transformers {transformers.__version__})", "",
                 f"`python benchmarks/draft_coverage.py --out {args.out}`: {summary}.", "",
                 "| model_type | result | detail |", "|---|---|---|"]
        lines += [f"| `{m}` | {s} | {d[:300].replace('|', chr(92) + '|')} |" for m, s, d, _ in rows]
        args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
