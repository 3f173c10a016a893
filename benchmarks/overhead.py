"""Where a decode-sized forward spends its time, op by op: unsharded, tpmap (its default collectives path and
gloo) and HF native TP side by side, on every rank, interleaved.

    torchrun --nproc-per-node 2 benchmarks/overhead.py [--shape 1x8] [--runs 20] [--md benchmarks/overhead.md]

The model is the Llama-shaped 160M of latency.py (random weights, built from its config, no download). Each
variant's forward runs under torch.profiler (CPU, no shapes); every op's *self* time is put in one bucket by
its name:

* matmul: aten::mm / addmm / bmm / matmul / linear;
* collectives: gloo's all-reduce/all-gather and their waits, tpmap's shared-memory ops (tpmap::shm_*);
* attention: scaled_dot_product_attention and its kernels;
* norms and activations: pow, mean, rsqrt, silu, the elementwise ops of RMSNorm and SwiGLU (mul, add, ...);
* copies and views: copy_, contiguous, cat, view, reshape, transpose, slicing, empty, ...;
* other ops.

"outside ops" is the forward's wall time minus all ops' self time: Python (modules, hooks, transformers'
own code) and dispatch. The median over rounds of the slowest rank is reported, in ms per forward; the
profiler adds its own cost to every op, so compare columns, not these numbers with latency.py's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from latency import rotated  # (the benchmarks folder is not a package)

BUCKETS = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("collectives", ("gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                     "tpmap::shm", "record_param_comms", "wait")),
    ("attention", ("scaled_dot_product", "_flash_attention", "attention")),
    ("norms and activations", ("aten::pow", "aten::mean", "aten::rsqrt", "aten::silu", "aten::mul", "aten::add",
                               "aten::neg", "aten::sin", "aten::cos", "aten::exp", "aten::div", "aten::sub")),
    ("copies and views", ("aten::copy_", "aten::contiguous", "aten::cat", "aten::view", "aten::reshape",
                          "aten::transpose", "aten::slice", "aten::select", "aten::empty", "aten::clone",
                          "aten::_to_copy", "aten::to", "aten::expand", "aten::unsqueeze", "aten::t",
                          "aten::as_strided", "aten::index", "aten::embedding", "aten::narrow", "aten::permute",
                          "aten::_unsafe_view", "aten::detach", "aten::zeros", "aten::full", "aten::arange")),
]


def bucket(name: str) -> str:
    for label, keys in BUCKETS:
        if any(k in name for k in keys):
            return label
    return "other ops"


def profile_once(fn) -> tuple[float, dict]:
    """(wall ms, {bucket: self ms}) of one call under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall = (time.perf_counter() - start) * 1e3
    out: dict[str, float] = {}
    for event in prof.key_averages():
        out[bucket(event.key)] = out.get(bucket(event.key), 0.0) + event.self_cpu_time_total / 1e3
    return wall, out


def _arguments():
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1x8")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--md", default=None)
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    batch, seq = (int(v) for v in args.shape.split("x"))

    import torch
    import torch.distributed as dist
    import transformers
    from latency import MODELS, gloo_group

    import tpmap
    from tpmap.engine import shm

    dist.init_process_group("gloo")
    torch.set_num_threads(args.threads)
    rank, ws = dist.get_rank(), dist.get_world_size()
    model_type, cls_name, sizes = MODELS["llama"]
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    base = cls(config).eval()
    state = base.state_dict()

    def fresh():
        m = cls(config).eval()
        m.load_state_dict(state)
        return m

    variants = {"unsharded": base, "tpmap": tpmap.apply(fresh(), ws)}
    if shm.chosen(None) is not None:
        variants["tpmap on gloo"] = tpmap.apply(fresh(), ws, group=gloo_group())
    import tempfile
    folder = [tempfile.mkdtemp(prefix="tpmap-overhead-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    if rank == 0:
        base.save_pretrained(folder[0])
    dist.barrier()
    variants["HF native TP"] = cls.from_pretrained(
        folder[0], distributed_config=transformers.DistributedConfig(tp_size=ws)).eval()
    ids = torch.randint(3, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    walls: dict[str, list] = {k: [] for k in variants}
    parts: dict[str, list] = {k: [] for k in variants}
    with torch.no_grad():
        for i in range(3 + args.runs):
            for key, model in rotated(variants, i):  # the order rotates: no variant always follows the same one
                dist.barrier()
                wall, by_bucket = profile_once(lambda model=model: model(input_ids=ids))
                if i >= 3:
                    walls[key].append(wall)
                    parts[key].append(by_bucket)
    labels = [b for b, _ in BUCKETS] + ["other ops"]
    rows = {}
    for key in variants:  # per round: the slowest rank's wall and that rank's buckets
        mine = torch.tensor([[w, *(p.get(b, 0.0) for b in labels)] for w, p in zip(walls[key], parts[key])],
                            dtype=torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(ws)]
        dist.all_gather(everyone, mine)
        stacked = torch.stack(everyone)  # (ws, rounds, 1 + buckets)
        slowest = stacked[:, :, 0].argmax(0)  # per round
        chosen = stacked[slowest, torch.arange(stacked.shape[1])]  # (rounds, 1 + buckets)
        med = [statistics.median(chosen[:, j].tolist()) for j in range(chosen.shape[1])]
        rows[key] = {"wall": med[0], **{b: med[1 + j] for j, b in enumerate(labels)}}
        rows[key]["outside ops"] = med[0] - sum(med[1:])
    if rank == 0:
        cols = list(variants)
        lines = [f"{time.strftime('%Y-%m-%d')}, Llama-shaped 160M, forward ({batch}, {seq}), {ws} ranks x "
                 f"{args.threads} thread, torch {torch.__version__}, transformers {transformers.__version__}; "
                 f"median of {args.runs} profiled rounds, the slowest rank, ms per forward", "",
                 "| | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for label in ["wall", *labels, "outside ops"]:
            lines.append(f"| {label} | " + " | ".join(f"{rows[k][label]:.1f}" for k in cols) + " |")
        text = "\n".join(lines)
        print(text)
        if args.md:
            with open(args.md, "w") as f:
                f.write(f"# A decode-sized forward, op by op\n\nGenerated by `torchrun --nproc-per-node {ws} "
                        f"benchmarks/overhead.py --shape {args.shape} --runs {args.runs} --md {args.md}`.\n\n"
                        + text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
