"""Per-rank bytes of a torchao-quantized model sharded by tpmap.apply, counted from the tensors each rank holds;
or (--checkpoint) the bytes each rank reads from a compressed-tensors checkpoint folder and holds after
tpmap.from_pretrained dequantizes its slices.

    torchrun --nproc-per-node N benchmarks/quantized_memory.py [--scheme int8|float8] [--md OUT]
    torchrun --nproc-per-node N benchmarks/quantized_memory.py --checkpoint W4A16|W8A8|FP8_DYNAMIC [--md OUT]

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
import shutil
import sys
from pathlib import Path

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
    parser.add_argument("--checkpoint", default=None, help="a compressed-tensors preset: W4A16, W8A8, FP8_DYNAMIC")
    args = parser.parse_args()
    if args.checkpoint:
        compressed_checkpoint(args.checkpoint, args.md)
        return

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


def compressed_checkpoint(preset: str, md: str | None) -> None:
    """The 160M saved in fp32 and compressed as llm-compressor writes `preset` (tests/compressed_cases.compress:
    compressed-tensors' own compressor, every nn.Linear but the LM head, W4A16 in groups of 128); each rank's
    bytes read from the folder (counted at the file reads) and its parameter bytes after tpmap.from_pretrained."""
    import tempfile

    import transformers

    import tpmap
    from tpmap.checkpoint.safetensors import SafetensorsFile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from compressed_cases import compress

    dist.init_process_group("gloo")
    ws, rank = dist.get_world_size(), dist.get_rank()
    folder = [tempfile.mkdtemp(prefix="tpmap-ct-") if rank == 0 else None]
    dist.broadcast_object_list(folder)
    folder = folder[0]
    if rank == 0:
        model_type, class_name, overrides = MODELS["llama"]
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(transformers.AutoConfig.for_model(model_type, **overrides))
        model.save_pretrained(folder)
        linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
        compress(Path(folder), preset, linears, 128 if preset.startswith("W4") else None)
    dist.barrier()
    read, original = [0], SafetensorsFile.read_into

    def counting(file, buffer, offset):
        read[0] += len(buffer)
        return original(file, buffer, offset)

    SafetensorsFile.read_into = counting
    try:
        model = tpmap.from_pretrained(folder, dtype=torch.bfloat16)
    finally:
        SafetensorsFile.read_into = original
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    mine = torch.tensor([read[0], held], dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(everyone, mine)
    rank_read, rank_held = (int(v) for v in torch.stack(everyone).max(0).values)
    if rank == 0:
        mib, stored = 2**20, sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        import compressed_tensors

        row = (f"| {preset} (compressed-tensors checkpoint) | {ws} | {stored / mib:.1f} | {rank_read / mib:.1f} | "
               f"{rank_read / stored:.3f} | {rank_held / mib:.1f} (bf16) |")
        print(f"{datetime.date.today()}, torch {torch.__version__}, "
              f"compressed-tensors {compressed_tensors.__version__}")
        print("| checkpoint | ws | file MiB | read MiB, largest rank | ratio | held MiB, largest rank |")
        print(row, flush=True)
        if md:
            with open(md, "a") as f:
                f.write(row + "\n")
        shutil.rmtree(folder)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
