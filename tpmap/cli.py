"""The `tpmap` command line: thin wrappers over the library.

    tpmap demo [--model DIR | --save DIR] [-n N] [--prompt TEXT]  the main job: sharded vs unsharded tokens, on CPU
    tpmap verify [MODEL_TYPE|FILE.yaml ...] [--all] [-n N ...]  prove mappings on real ranks (--model DIR: yours)
    tpmap plan MODEL_TYPE|FILE.yaml|DIR -n N [--rank R] [--seq-len L]  print the plan (DIR: your model's)
    tpmap lint [PATH ...] [--format text|json|github]            check mapping files statically
    tpmap lint --schema-only [PATH ...]                          the schema alone, without torch/transformers (fast)
    tpmap schema                                                 print the mapping JSON Schema
    tpmap models [-o MODELS.md]                                  the table of shipped mappings and their proofs
    tpmap draft MODEL_TYPE [-o FILE]                             write a starting mapping (a draft)
    tpmap export-checkpoint CKPT OUT [--max-shard-size SIZE]     a training checkpoint as a transformers folder
"""
from __future__ import annotations

import argparse
import os
import sys

NOTHING_VERIFIED = 3  # tpmap verify's exit status when every mapping named was skipped (documented in its --help)
# tpmap lint --schema-only's help: written here, not imported from tpmap.lint (that would cost `tpmap --help` its
# 0.1 s start); tpmap/lint/__init__.py and docs/lint.md say the same
SCHEMA_ONLY_HELP = (
    "the schema rules alone (YAML syntax, duplicate keys, unknown keys and kinds, wrong types, invalid expressions: "
    "`tpmap lint --rules --schema-only`), without importing torch or transformers: a fraction of a second, for "
    "editors and pre-commit hooks. Left out: every check that needs transformers' config or model classes: all the "
    "structural rules, among them config-attribute (a name in an expression, a verify config key or an input shape "
    "that the model type's config lacks), unknown-model-type, unknown-model-class, when-attribute and "
    "transformers-never; the unknown-key of a verify input that is no argument of the class's forward and the "
    "missing-key of a class's main input other than input_ids; compose (composed sub-models' mappings are not "
    "read); and the transformers-version note. A file clean here can still fail the full lint"
)


def _verify(args) -> int:
    from tpmap import verify
    from tpmap.language import source

    if args.model:  # the user's own checkpoint, real weights
        from tpmap import verify_model
        if args.all or args.model_types:
            print("tpmap verify: --model DIR proves one checkpoint; name no model types and no --all", file=sys.stderr)
            return 2
        dtype = getattr(__import__("torch"), args.dtype)
        return max(verify_model.run(args.model, n, dtype=dtype) for n in (args.world_size or [2]))
    shipped = list(source.shipped_files())
    refs = shipped if args.all else args.model_types
    if not refs:
        print("tpmap verify: name model types or mapping files, or pass --all", file=sys.stderr)
        return 2
    unknown = [m for m in refs if m not in shipped and not m.endswith((".yaml", ".yml"))]
    if unknown:
        for name in unknown:
            print(f"tpmap verify: {source.unknown_model_type(name, shipped)} (Or give a path to a .yaml file.)",
                  file=sys.stderr)
        return 2
    from tpmap.compat import check_transformers, mapping_applies

    check_transformers()  # an untested transformers release: refused here as in apply
    needs = {r: verify.resolve(r).mapping.transformers for r in refs}  # each mapping read once
    skipped = [r for r, spec in needs.items() if not mapping_applies(spec)]
    for r in skipped:
        print(f"{r}: not verified: the mapping needs transformers{needs[r]}", flush=True)
    refs = [r for r in refs if r not in skipped]
    case_list = verify.cases(refs, args.world_size)
    if args.filter:  # a substring of 'model_type config class' (e.g. "[parallel]", "Model", "moe")
        case_list = [c for c in case_list if args.filter in f"{c.model_type} {c.config_name} {c.class_name}"]
    if not case_list and skipped:
        print(f"tpmap verify: nothing verified: {', '.join(skipped)} need another transformers release",
              file=sys.stderr)
        return NOTHING_VERIFIED
    if not case_list:
        print("tpmap verify: no case matches those world sizes and that filter", file=sys.stderr)
        return 2
    print(verify.header(case_list), flush=True)
    if args.jobs < 1:
        print("tpmap verify: --jobs must be at least 1", file=sys.stderr)
        return 2
    results = verify.run(case_list, timeout=args.timeout, log=lambda line: print(line, flush=True),
                         verbose=args.verbose, jobs=args.jobs)
    failed = [r for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def _plan(args) -> int:
    import torch
    import transformers
    from transformers import AutoConfig

    from tpmap import api, plan_report, verify

    if plan_report.is_user_config(args.model_type):  # a checkpoint folder or a config.json: the user's own model
        print(plan_report.report(args.model_type, args.n, mapping=args.mapping, model_class=args.model_class,
                                 dtype=args.dtype, seq_len=args.seq_len))
        return 0

    loaded = verify.resolve(args.model_type)  # a model type (shipped mapping) or a YAML path
    model_type = loaded.mapping.model_type
    spec = loaded.mapping.verify[0]
    config = AutoConfig.for_model(model_type, **({} if args.default_config else spec.config))
    cls = getattr(transformers, args.model_class or spec.models[0])
    with torch.device("meta"):  # structure and shapes only: no memory, no weights
        model = cls(config)
    plan = api.plan(model, args.n, mapping=loaded)
    which = "default" if args.default_config else f"embedded '{spec.name}'"
    print(f"# {model_type} ({cls.__name__}, {which} config), world size {args.n}, mapping {plan.source}")
    print(_balance(plan, model))
    print(plan.table(args.rank))
    return 0


def _balance(plan, model) -> str:
    """Each rank's query heads and share of the parameters, with max/mean (1.00: balanced)."""
    def line(what: str, values, fmt) -> str:
        mean = sum(values) / len(values)
        return (f"# {what} per rank: {', '.join(fmt(v) for v in values)} (max/mean "
                f"{max(values) / mean if mean else 1.0:.2f}{', uneven' if len(set(values)) > 1 else ''})")

    full = {name: p.numel() for name, p in model.named_parameters()}  # tied parameters once, under their first name
    lines = []
    if plan.heads:
        lines.append(line(f"heads (of {plan.heads[0]})", plan.rank_heads(), str))
    lines.append(line(f"share of {sum(full.values()):,} parameters", plan.rank_shares(full), lambda v: f"{v:.1%}"))
    return "\n".join(lines)


def _models(args) -> int:
    from tpmap import catalog

    text = catalog.render(catalog.rows())
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _lint(args) -> int:
    from tpmap import lint
    from tpmap.lint import report

    if args.rules:  # with --schema-only: the rules that mode checks
        rules = {r: w for r, w in lint.RULES.items() if not args.schema_only or r in lint.SCHEMA_RULES}
        width = max(map(len, rules))
        print("\n".join(f"{rule.ljust(width)}  {what}" for rule, what in rules.items()))
        return 0
    try:  # --schema-only: tpmap.language.source alone, neither torch nor transformers is imported
        files, diagnostics = lint.lint_paths(args.paths, schema_only=args.schema_only)
    except lint.LintUsageError as e:
        print(f"tpmap lint: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(report.render(args.format, files, diagnostics))
    return 1 if any(d.severity == "error" for d in diagnostics) else 0


def _schema(args) -> int:
    import json

    from tpmap.language.schema import json_schema

    print(json.dumps(json_schema(), indent=2))
    return 0


def _draft(args) -> int:
    from tpmap import draft

    text = draft.draft(args.model_type)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    todos = text.count("TODO:")
    print(f"tpmap draft: wrote {args.output} ({todos} TODO{'s' if todos != 1 else ''}); next: "
          f"tpmap lint {args.output} && tpmap verify {args.output}", file=sys.stderr)
    return 0


def _demo(args) -> int:
    from tpmap import demo

    if args.model and args.save:
        print("tpmap demo: --save keeps the embedded tiny checkpoint; it cannot be combined with --model",
              file=sys.stderr)
        return 2
    return demo.run(args.model, args.world_size, args.prompt or demo.PROMPT, args.new_tokens, save=args.save)


def _export_checkpoint(args) -> int:
    from tpmap import training

    out = training.export(args.checkpoint, args.output, max_shard_size=args.max_shard_size)
    print(f"tpmap export-checkpoint: wrote {out} (loads with AutoModelForCausalLM.from_pretrained)", file=sys.stderr)
    return 0


def _version() -> str:
    """tpmap's version and those of the libraries it runs on, read from the installed metadata (no import)."""
    from importlib import metadata

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"
    return (f"tpmap {installed('tpmap')} (torch {installed('torch')}, transformers {installed('transformers')}, "
            f"python {sys.version.split()[0]})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpmap", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=_version(), help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_demo_verify_plan(sub)

    p = sub.add_parser("lint", help="check mapping files against the schema and the real model structure",
                       description="Check mapping files statically: schema, then the mapping against each model "
                       "built on the meta device (no weights, no process group); --schema-only: the schema alone, "
                       "without torch or transformers (fast; see below). Exit status: 0 clean, 1 errors, "
                       "2 usage error.")
    p.add_argument("paths", nargs="*", metavar="PATH", help="mapping files or folders (default: the shipped mappings)")
    p.add_argument("--format", choices=("text", "json", "github"), default="text",
                   help="text (default), json, or github (GitHub Actions ::error annotations)")
    p.add_argument("--schema-only", action="store_true", help=SCHEMA_ONLY_HELP)
    p.add_argument("--rules", action="store_true", help="list the rule ids and exit (with --schema-only: its rules)")
    p.set_defaults(func=_lint)

    p = sub.add_parser("models", help="the table of shipped mappings and what CI proves for each (MODELS.md)")
    p.add_argument("-o", "--output", default=None, help="write it to this file instead of stdout")
    p.set_defaults(func=_models)

    p = sub.add_parser("schema", help="print the JSON Schema of mapping files (for editors)")
    p.set_defaults(func=_schema)

    p = sub.add_parser("draft", help="write a starting mapping for a model type from its module structure",
                       description="Write a starting mapping for MODEL_TYPE from the structure of a tiny model "
                       "built on the meta device (and the config's base_model_tp_plan where transformers ships "
                       "one). Layouts that shapes cannot tell are marked # TODO. A start, not a proof: run "
                       "tpmap lint and tpmap verify on it.")
    p.add_argument("model_type", metavar="MODEL_TYPE", help="a transformers config.model_type, e.g. mistral")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of standard output")
    p.set_defaults(func=_draft)

    p = sub.add_parser("export-checkpoint", help="a training checkpoint (tpmap.training) as a transformers folder",
                       description="Assemble the model of a training checkpoint written by tpmap.training.save (its "
                       "directory, whose latest step is read, or one step folder) into a standard save_pretrained "
                       "folder, one tensor at a time, in one process. Optimizer state and RNG are left out.")
    p.add_argument("checkpoint", metavar="CKPT", help="the training checkpoint directory or a step folder in it")
    p.add_argument("output", metavar="OUT", help="the folder to write (config.json + safetensors)")
    p.add_argument("--max-shard-size", default="50GB", help="split files above this size, as save_pretrained")
    p.set_defaults(func=_export_checkpoint)
    return parser


def _add_demo_verify_plan(sub) -> None:
    """The parsers of the commands a new user meets first."""
    p = sub.add_parser("demo", help="the main job: a model sharded over CPU ranks, its tokens against the unsharded",
                       description="Shard a model over CPU workers (tpmap.parallelize, no torchrun), generate "
                       "greedily, and compare the tokens with the unsharded model's. Default: a tiny Llama with fixed "
                       "weights, no download (about a minute on 2 cores). Exit status: 0 equal tokens, 1 they differ.")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a checkpoint folder (default: the embedded tiny Llama)")
    p.add_argument("-n", "--world-size", type=int, default=2, help="CPU workers (default 2)")
    p.add_argument("--prompt", default=None, help="the prompt (default: a fixed sentence)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens to generate (default 24)")
    p.add_argument("--save", metavar="DIR", default=None,
                   help="keep the tiny checkpoint in DIR (the README's snippets load it from tiny-llama)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("verify", help="compare sharded and unsharded models on real gloo ranks",
                       description="Prove mappings on their embedded tiny configs: the sharded model against the "
                       "unsharded one on real gloo ranks (forward, parameter share, collectives). Exit status: 0 "
                       "every case passed, 1 a case failed, 2 usage error, "
                       f"{NOTHING_VERIFIED} nothing verified (every mapping named needs another transformers release).")
    p.add_argument("model_types", nargs="*", metavar="MODEL_TYPE|FILE.yaml",
                   help="shipped model types or mapping files to prove")
    p.add_argument("--all", action="store_true", help="every shipped mapping")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="your checkpoint folder instead: sharded vs unsharded logits and greedy tokens on its real "
                   "weights, on CPU workers (-n N, default 2), with the peak memory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="with --model: the dtype both models run in (default float32: differences are the mapping's)")
    p.add_argument("--world-size", "-n", type=int, action="append", help="only these world sizes (repeatable)")
    p.add_argument("-k", "--filter", default=None, metavar="TEXT",
                   help="only the cases whose 'model_type config class' contains TEXT (e.g. '[parallel]', 'moe')")
    p.add_argument("-j", "--jobs", type=int, default=1,
                   help="cases run at once, each on its own ranks (default 1; up to the cores / world size pays)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per case before a rank counts as hung")
    p.add_argument("--verbose", "-v", action="store_true", help="every failing rank's whole traceback")
    p.set_defaults(func=_verify)

    p = sub.add_parser("plan", help="print which rank holds which slice, without running anything",
                       description="MODEL_TYPE or FILE.yaml: the plan of the mapping's tiny config as a table. "
                       "DIR or config.json: your model's plan on the meta device (no weights read): the mapping, "
                       "each rank's weights and KV cache in bytes, the world sizes that work, the collectives.")
    p.add_argument("model_type", metavar="MODEL_TYPE|FILE.yaml|DIR|config.json",
                   help="a shipped model type, a mapping file, a checkpoint folder or a config.json")
    p.add_argument("-n", "--world-size", dest="n", type=int, required=True, help="the world size to plan for")
    p.add_argument("--rank", type=int, default=None, help="only this rank's pieces")
    p.add_argument("--default-config", action="store_true", help="the model type's default config, not the tiny one")
    p.add_argument("--model-class", default=None,
                   help="transformers class (default: the config's architectures, else the first in the mapping)")
    p.add_argument("--mapping", default=None, metavar="FILE.yaml",
                   help="with DIR or config.json: this mapping file (default: the shipped one for its model_type)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="with DIR or config.json: bytes per element (default: the config's dtype, else float32)")
    p.add_argument("--seq-len", type=int, default=4096,
                   help="with DIR or config.json: tokens of the KV cache estimate, batch 1 (default 4096)")
    p.set_defaults(func=_plan)


def main(argv=None) -> int:
    from tpmap.language.errors import TpmapError

    args = build_parser().parse_args(argv)
    if argv is None:  # the tpmap command itself (a caller passing argv keeps its process's logging as it is)
        from tpmap.parallelize.quiet import quiet

        quiet()  # third-party noise that tpmap's own commands trigger (before transformers is imported)
    try:
        return args.func(args)
    except TpmapError as e:
        print(f"tpmap {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader stopped early (`tpmap schema | head`): no traceback, as cat or grep
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit cannot raise again
        return 1


if __name__ == "__main__":
    sys.exit(main())
