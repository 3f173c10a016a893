"""Which world sizes each shipped mapping serves with transformers' default config of its model type (real
sizes: ``AutoConfig.for_model(model_type)``), from plans alone (meta device, nothing runs).

A mapping *serves* world size N when its first verify config's model class, built from the default config,
plans at N (tpmap.plan); ``--tiny`` plans the verify config itself instead. With
``--all-uneven`` every mapping is planned as if it said ``uneven: true``: the counts the uneven rule could reach
once every mapping is proven at uneven world sizes.

    python benchmarks/world_sizes.py [--sizes 2 3 4 8] [--all-uneven] [--tiny] [--list N]
"""
from __future__ import annotations

import argparse
import dataclasses
import warnings

import torch
import transformers
from transformers import AutoConfig

from tpmap.engine import planner
from tpmap.errors import TpmapError
from tpmap.language import source


def _model(mapping, tiny: bool):
    spec = mapping.verify[0]
    config = AutoConfig.for_model(mapping.model_type, **(spec.config if tiny else {}))
    with torch.device("meta"):
        return getattr(transformers, spec.models[0])(config)


def served(sizes: list[int], all_uneven: bool, tiny: bool = False) -> dict[int, list[str]]:
    """{world size: the model types served at it}; a model that does not build is served nowhere."""
    out: dict[int, list[str]] = {n: [] for n in sizes}
    for model_type, path in sorted(source.shipped_files().items()):
        loaded = source.read_file(path)
        if all_uneven:
            loaded = dataclasses.replace(loaded, mapping=loaded.mapping.model_copy(update={"uneven": True}))
        try:
            model = _model(loaded.mapping, tiny)
        except Exception as e:
            print(f"# {model_type}: does not build ({type(e).__name__}: {str(e)[:80]})")
            continue
        for n in sizes:
            try:
                planner.build_plan(model, loaded, n)
            except TpmapError:
                continue
            out[n].append(model_type)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--all-uneven", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="plan the first verify config, not the default")
    parser.add_argument("--list", type=int, help="list the model types NOT served at this world size")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    total = len(source.shipped_files())
    result = served(args.sizes, args.all_uneven, args.tiny)
    for n in args.sizes:
        print(f"world size {n}: {len(result[n])} of {total} mappings serve their default config")
    if args.list:
        missing = sorted(set(source.shipped_files()) - set(result[args.list]))
        print(f"not served at {args.list}: {' '.join(missing)}")


if __name__ == "__main__":
    main()
