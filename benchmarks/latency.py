"""Latency of tpmap against Hugging Face native TP and the unsharded model, side by side, in one run.

    torchrun --nproc-per-node 2 benchmarks/latency.py [--models llama,mixtral,gpt2,bert] [--runs 10]
        [--backend gloo|nccl] [--threads 1] [--json out.json] [--workdir DIR] [--quick]

Every model is built from a config (no download), saved once with `save_pretrained` by rank 0, and loaded
by every rank three ways from that one folder: unsharded (`Cls.from_pretrained`), tpmap
(`tpmap.from_pretrained`) and HF native TP (`from_pretrained(..., distributed_config=DistributedConfig(
tp_size=ws))`, where the config class ships a `base_model_tp_plan`; the `bench` extra installs the
`accelerate` it needs). The variants are timed *interleaved*, round by round (in an order that rotates each
round), so the machine's noise hits them alike; every timing is the slowest rank's (a barrier before, the max
over ranks after), reported as the median and the 10th-90th percentile spread over the rounds.

* forward, eval, no grad, batch shapes (1, 8) and (4, 128);
* greedy generate: prompt 128 tokens, 64 new, batch 1, dynamic and static cache: new tokens per second,
  and whether every variant produced the same tokens;
* a training step: forward + backward + AdamW step at (4, 128), labels = inputs;
* with `--compile BACKEND`, the tpmap forward also compiled (`torch.compile(model.forward)`, warm-up rounds
  absorb the compilation), beside eager.

Models (`--quick` shrinks them for a smoke run): a Llama-shaped 160M (hidden 768, 12 layers, 12 heads,
intermediate 2048, vocabulary 32000), a Mixtral-shaped MoE (8 experts, top 2), GPT-2 small and BERT base
(HF ships no plan for these two: tpmap against unsharded only).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

MODELS = {
    "llama": ("llama", "LlamaForCausalLM", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                                 num_key_value_heads=12, intermediate_size=2048, vocab_size=32000,
                                                 max_position_embeddings=512, tie_word_embeddings=False)),
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                                       num_key_value_heads=8, intermediate_size=1024,
                                                       num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                                                       max_position_embeddings=512)),
    "gpt2": ("gpt2", "GPT2LMHeadModel", dict(n_positions=512)),
    "bert": ("bert", "BertForMaskedLM", dict()),
}
QUICK = dict(hidden_size=96, num_hidden_layers=2, intermediate_size=192, n_embd=96, n_layer=2, vocab_size=1000)
SHAPES = [(1, 8), (4, 128)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summary(seconds: list[float]) -> dict:
    return {"median": statistics.median(seconds), "p10": percentile(seconds, 0.1), "p90": percentile(seconds, 0.9),
            "rounds": len(seconds)}


def rotated(variants: dict, i: int) -> list:
    """Round i's order: the variants rotated by i, so that none always runs right after the same one (the
    variant after the unsharded model, whose ranks never synchronise, would always start from a wider skew at
    the barrier, and every variant inherits the caches its predecessor left)."""
    items = list(variants.items())
    k = i % len(items)
    return items[k:] + items[:k]


class Timer:
    """Interleaved rounds; per round, each variant's time on the slowest rank."""

    def __init__(self, device):
        import torch.distributed as dist

        self.dist, self.device, self.times = dist, device, {}
        self.gathered: dict[str, list[float]] = {}  # key -> the slowest rank's time per round

    def __call__(self, key: str, fn):
        import torch

        self.dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.times.setdefault(key, []).append(time.perf_counter() - start)
        return out

    def rounds(self, key: str, skip: int) -> list[float]:
        """The slowest rank's time per round for `key`, warm-up rounds dropped (one gather per key, all keys
        at once: every rank has the same keys in the same order)."""
        import torch

        if not self.gathered:
            for k, values in sorted(self.times.items()):
                mine = torch.tensor(values, dtype=torch.float64)
                everyone = [torch.empty_like(mine) for _ in range(self.dist.get_world_size())]
                self.dist.all_gather(everyone, mine)
                self.gathered[k] = torch.stack(everyone).max(0).values.tolist()
        return self.gathered[key][skip:]


_GLOO_GROUP: list = []  # one group over every rank that stays on torch.distributed (TPMAP_SHM=0 at its first use)


def gloo_group():
    """A process group over all ranks whose tpmap collectives stay on gloo, to time beside the default path."""
    import torch.distributed as dist

    from tpmap.engine import shm

    if not _GLOO_GROUP:
        group = dist.new_group(list(range(dist.get_world_size())))
        before = os.environ.get("TPMAP_SHM")
        os.environ["TPMAP_SHM"] = "0"
        shm.for_group(group)
        if before is None:
            del os.environ["TPMAP_SHM"]
        else:
            os.environ["TPMAP_SHM"] = before
        _GLOO_GROUP.append(group)
    return _GLOO_GROUP[0]


def deepspeed_autotp(cls, folder: str, world_size: int):
    """DeepSpeed's AutoTP (inference) on the unsharded model, with its shared-memory all-reduce on CPU
    (`deepspeed_shm_comm`, built at first use; it reads LOCAL_SIZE, which the deepspeed launcher sets)."""
    import deepspeed
    import torch

    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    deepspeed.init_distributed(dist_backend="gloo")
    engine = deepspeed.init_inference(cls.from_pretrained(folder).eval(), tensor_parallel={"tp_size": world_size},
                                      dtype=torch.float32, replace_with_kernel_inject=False)
    return engine.module


def load_variants(name: str, folder: str, world_size: int, device, with_hf: bool,
                  compile_backend: str | None = None, with_deepspeed: bool = False) -> dict:
    import torch
    import transformers

    import tpmap
    from tpmap.engine import shm

    _, cls_name, _ = MODELS[name]
    cls = getattr(transformers, cls_name)
    variants = {"unsharded": cls.from_pretrained(folder).to(device).eval()}
    variants["tpmap"] = tpmap.from_pretrained(folder, model_class=cls_name, device=device).eval()
    if shm.chosen(None) is not None:  # the default path is shared memory: time gloo beside it
        variants["tpmap_gloo"] = tpmap.from_pretrained(folder, model_class=cls_name, device=device,
                                                       group=gloo_group()).eval()
    if with_deepspeed:
        variants["deepspeed"] = deepspeed_autotp(cls, folder, world_size)
    if with_hf:
        config = transformers.DistributedConfig(tp_size=world_size)
        variants["hf_tp"] = cls.from_pretrained(folder, distributed_config=config).eval()
    if compile_backend:  # the same tpmap model, forward compiled (generate and training stay eager)
        variants["tpmap_compiled"] = tpmap.from_pretrained(folder, model_class=cls_name, device=device).eval()
        variants["tpmap_compiled"].forward = torch.compile(variants["tpmap_compiled"].forward,
                                                           backend=compile_backend, dynamic=False)
    return variants


def bench_model(name: str, args, folder: str, device) -> dict:
    import torch
    import torch.distributed as dist
    import transformers

    model_type, cls_name, _ = MODELS[name]
    ws = dist.get_world_size()
    with_hf = bool(getattr(transformers.AutoConfig.for_model(model_type), "base_model_tp_plan", None))
    variants = load_variants(name, folder, ws, device, with_hf, args.compile, args.deepspeed)
    vocab = variants["unsharded"].config.vocab_size
    gen = torch.Generator().manual_seed(0)
    timer = Timer(device)
    result: dict = {"model": name, "class": cls_name, "world_size": ws,
                    "params": sum(p.numel() for p in variants["unsharded"].parameters()), "variants": list(variants)}
    warmup = 2
    with torch.no_grad():
        for batch, seq in SHAPES:
            ids = torch.randint(3, vocab, (batch, seq), generator=gen).to(device)
            for i in range(warmup + args.runs):
                for key, model in rotated(variants, i):
                    timer(f"forward {batch}x{seq} {key}", lambda model=model, ids=ids: model(input_ids=ids))
    eager = {k: m for k, m in variants.items() if k != "tpmap_compiled"}  # generate: eager
    causal = cls_name.endswith(("ForCausalLM", "LMHeadModel")) and "generate" not in args.skip
    if causal:
        prompt = torch.randint(3, vocab, (1, args.prompt), generator=gen).to(device)
        tokens = {}
        for cache in ("dynamic", "static"):
            kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                          pad_token_id=0, attention_mask=torch.ones_like(prompt))
            if cache == "static":
                kwargs["cache_implementation"] = "static"
            for i in range(1 + args.generate_runs):
                for key, model in rotated(eager, i):
                    out = timer(f"generate {cache} {key}", lambda model=model, kw=kwargs: model.generate(prompt, **kw))
                    tokens[(cache, key)] = out[0, prompt.shape[1]:].tolist()
        result["same_tokens"] = {cache: len({tuple(tokens[(cache, k)]) for k in eager}) == 1
                                 for cache in ("dynamic", "static")}
    batch, seq = SHAPES[-1]
    ids = torch.randint(3, vocab, (batch, seq), generator=gen).to(device)
    torch.manual_seed(1234)  # the same RNG state on every rank in training (tpmap's input check compares it)
    optimizers = {}
    eager = {k: m for k, m in eager.items() if k != "deepspeed"}  # training: AutoTP here is inference only
    for key, model in eager.items():
        model.train()
        optimizers[key] = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(model, optimizer):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(1 + args.train_runs if "train" not in args.skip else 0):
        for key, model in rotated(eager, i):
            timer(f"train {batch}x{seq} {key}", lambda model=model, opt=optimizers[key]: step(model, opt))
    seconds = {key: summary(timer.rounds(key, warmup if key.startswith("forward") else 1))
               for key in sorted(timer.times)}  # warm-up rounds dropped
    for key, s in seconds.items():
        if key.startswith("generate"):
            s["tokens_per_s"] = args.new_tokens / s["median"]
    result["seconds"] = seconds
    del variants, optimizers
    return result


COLUMNS = [("unsharded", "unsharded"), ("tpmap", "tpmap"), ("tpmap_gloo", "tpmap on gloo"), ("hf_tp", "HF native TP"),
           ("deepspeed", "DeepSpeed AutoTP"), ("tpmap_compiled", "tpmap compiled")]
RATIOS = [("unsharded", "tpmap / unsharded"), ("hf_tp", "tpmap / HF"), ("deepspeed", "tpmap / DeepSpeed")]


def table(results: list[dict]) -> str:
    """One row per (model, measurement): median seconds per variant (spread p10-p90), and tpmap's ratios."""
    present = [c for c in COLUMNS if any(f" {c[0]}" in k and k.endswith(c[0]) for r in results for k in r["seconds"])]
    lines = ["| model | measurement | " + " | ".join(h for _, h in present) + " | " + " | ".join(h for _, h in RATIOS)
             + " |", "|---|---|" + "---|" * (len(present) + len(RATIOS))]

    def fmt(s):
        if s is None:
            return "-"
        if "tokens_per_s" in s:
            return f"{s['tokens_per_s']:.1f} tok/s"
        return f"{s['median'] * 1e3:.1f} ms ({s['p10'] * 1e3:.0f}-{s['p90'] * 1e3:.0f})"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a['median'] / b['median']:.2f}"

    for r in results:
        kinds = sorted({k.rsplit(" ", 1)[0] for k in r["seconds"]}, key=lambda k: (k.split()[0] != "forward", k))
        for kind in kinds:
            cells = {v: r["seconds"].get(f"{kind} {v}") for v, _ in COLUMNS}
            lines.append(f"| {r['model']} | {kind} | " + " | ".join(fmt(cells[v]) for v, _ in present) + " | "
                         + " | ".join(ratio(cells["tpmap"], cells[v]) for v, _ in RATIOS) + " |")
    lines.append("")
    lines.append("Ratios are of median times (lower is faster; for generate, time per call of "
                 "the same number of tokens).")
    for r in results:
        if "same_tokens" in r:
            lines.append(f"{r['model']}: same generated tokens in every variant: {r['same_tokens']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama,mixtral,gpt2,bert")
    parser.add_argument("--runs", type=int, default=10, help="forward rounds per shape (after 2 warm-up)")
    parser.add_argument("--generate-runs", type=int, default=3)
    parser.add_argument("--train-runs", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--backend", default=None, help="gloo (CPU, default) or nccl (GPU)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank on CPU")
    parser.add_argument("--workdir", default=None, help="where rank 0 saves the checkpoints (a shared folder "
                        "across nodes; default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few rounds: a smoke run")
    parser.add_argument("--compile", default=None, metavar="BACKEND", help="also time the tpmap forward under "
                        "torch.compile with this backend (inductor: needs a C++ compiler on CPU; aot_eager)")
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeed AutoTP (inference: forward and "
                        "generate), with its shared-memory all-reduce on CPU (pip install deepspeed)")
    parser.add_argument("--shapes", default=None, help="forward shapes, e.g. 1x8,4x128 (default)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: generate, train")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.shapes:
        SHAPES[:] = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.quick:
        args.runs, args.generate_runs, args.train_runs, args.prompt, args.new_tokens = 2, 1, 1, 16, 8

    import torch
    import torch.distributed as dist
    import transformers

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(args.threads)
    workdir = [args.workdir or (tempfile.mkdtemp(prefix="tpmap-latency-") if rank == 0 else None)]
    dist.broadcast_object_list(workdir, src=0)  # rank 0's folder (one node; pass --workdir across nodes)
    workdir = workdir[0]
    results = []
    for name in args.models.split(","):
        model_type, cls_name, sizes = MODELS[name]
        folder = os.path.join(workdir, name + ("-quick" if args.quick else ""))
        if rank == 0 and not os.path.exists(os.path.join(folder, "config.json")):
            config = transformers.AutoConfig.for_model(model_type, **sizes)
            if args.quick:
                config.update({k: v for k, v in QUICK.items() if hasattr(config, k)})
            torch.manual_seed(0)
            getattr(transformers, cls_name)(config).save_pretrained(folder)
        dist.barrier()
        results.append(bench_model(name, args, folder, device))
        if rank == 0:
            print(f"{name}: done", flush=True)
    if rank == 0:
        where = f"{dist.get_world_size()} ranks, {backend}, " + (
            f"{args.threads} thread(s) per rank" if backend == "gloo" else torch.cuda.get_device_name())
        print(f"\n{time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}\n")
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "where": where, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
