"""Per-rank bytes of a torchao-quantized model sharded by tpmap.apply, counted from the tensors each rank holds.

    torchrun --nproc-per-node N benchmarks/quantized_memory.py [--scheme int8|float8] [--md OUT]

A Llama-shaped 160M (benchmarks/latency.py's), every nn.Linear but the LM head quantized by torchao
(`quantize_`, int8 or float8 weight-only), then sharded over the N ranks. Rank 0 prints, exactly: the bytes of the
quantized tensors (their data and scales, counted through `__tensor_flatten__`) and of all parameters, on the
unsharded model and on each rank (the largest rank), and the ratio to the unsharded model. No timing: the
numbers do not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency import MODELS  # (the benchmarks folder is not a package)


def nbytes(t: torch.Tensor) -> int:
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
    return t.numel() * t.element_size()


def counts(model) -> tuple[int, int]:
    """(bytes of the quantized parameters, bytes of all parameters)."""
    params = list(model.parameters())
    return sum(nbytes(p) for p in params if hasattr(p, "__tensor_flatten__")), sum(nbytes(p) for p in params)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheme", choices=["int8", "float8"], default="int8")
    parser.add_argument("--md", default=None, help="append the table row(s) to this file")
    args = parser.parse_args()

    import torchao.quantization as q
    import transformers

    import tpmap

    dist.init_process_group("gloo")
    ws, rank = dist.get_world_size(), dist.get_rank()
    model_type, class_name, overrides = MODELS["llama"]
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(transformers.AutoConfig.for_model(model_type, **overrides)).eval()
    head = model.get_output_embeddings()
    config = q.Int8WeightOnlyConfig() if args.scheme == "int8" else q.Float8WeightOnlyConfig()
    q.quantize_(model, config, filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and m is not head)
    full_q, full_all = counts(model)
    sharded = tpmap.apply(copy.deepcopy(model), ws)
    mine = torch.tensor(counts(sharded), dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(everyone, mine)
    rank_q, rank_all = (int(v) for v in torch.stack(everyone).max(0).values)
    if rank == 0:
        mib = 2**20
        row = (f"| {args.scheme} weight-only | {ws} | {full_q / mib:.1f} | {rank_q / mib:.1f} | "
               f"{rank_q / full_q:.3f} | {full_all / mib:.1f} | {rank_all / mib:.1f} | {rank_all / full_all:.3f} |")
        import torchao

        print(f"{datetime.date.today()}, torch {torch.__version__}, torchao {torchao.__version__}")
        print("| scheme | ws | quantized MiB, unsharded | quantized MiB, largest rank | ratio "
              "| all params MiB, unsharded | all params MiB, largest rank | ratio |")
        print(row, flush=True)
        if args.md:
            with open(args.md, "a") as f:
                f.write(row + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
