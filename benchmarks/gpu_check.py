"""A prepared check for a machine with a GPU (not part of CI): the sharded model on CUDA tensors.

Ranks are real processes in a gloo group (one GPU cannot host an NCCL group of several ranks). Each
rank shards the model on the CPU with tpmap.apply, moves it to the GPU, and compares against the
unsharded model on the GPU: forward, gradients (replicated KV heads at world size 4), greedy generate,
and train-mode dropout (the CUDA generator is swapped in sharded regions). Also times forwards.

    python benchmarks/gpu_check.py [--world-sizes 2 4]     # everything below, then the GPU table and a verdict
    python benchmarks/gpu_check.py --correctness-only      # the cases only (one GPU is enough)
    python benchmarks/gpu_check.py --symm-mem              # the NCCL part only (one GPU per rank, 2 or more)

The NCCL part (every world size with a GPU per rank) compares NCCL with the opt-in symmetric-memory all-reduce
(engine.symm_mem, TPMAP_SYMM_MEM=1) on NCCL ranks, one GPU each: the latency of one all-reduce per message size
and dtype, whether every rank holds the same bits and how far they are from NCCL's sum, a sharded Llama's logits
and greedy tokens with the switch on against off, and the GPU table: latency.py's 170 M Llama shape in bf16,
forward (1, 8) and (4, 128) and greedy decode tokens/s, unsharded (one GPU per rank, each its own copy) against
tpmap on NCCL and on symmetric memory (the slowest rank's time, medians of 10 after 3 warm-up).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CASES = [("gpt2", 0, "GPT2LMHeadModel"), ("llama", 0, "LlamaForCausalLM"), ("t5", 0, "T5ForConditionalGeneration")]


def rank_check(ref: str, index: int, cls: str) -> dict:
    import rank_cases
    import torch.distributed as dist

    import tpmap
    from tpmap import verify
    from tpmap.engine.shard import take

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ws, rank = dist.get_world_size(), dist.get_rank()
    cpu_model = verify.build_model(ref, index, cls)
    full = copy.deepcopy(cpu_model).to(device)
    sharded = tpmap.apply(copy.deepcopy(cpu_model), ws).to(device)  # shard on the CPU, then move: the usual order
    inputs, _ = rank_cases.loss_kwargs(full, verify.case_inputs(ref, index, full))
    inputs = {k: v.to(device) for k, v in inputs.items()}
    out_full, out = full(**inputs), sharded(**inputs)
    fwd = (verify.main_output(out) - verify.main_output(out_full)).abs().max().item()
    scale = verify.main_output(out_full).abs().max().item()
    out_full.loss.backward()
    out.loss.backward()
    grads = {n: p.grad for n, p in full.named_parameters()}
    plan, worst = sharded.tpmap_plan, 0.0
    gmax = max(g.abs().max().item() for g in grads.values() if g is not None)
    for name, p in sharded.named_parameters():
        want = grads[name]
        if p.grad is None or want is None:
            continue
        if name in plan.params:
            want = take(want, plan.params[name], rank)
        worst = max(worst, (p.grad - want).abs().max().item() / max(want.abs().max().item(), 1e-2 * gmax))
    gen_ids = inputs["input_ids"][:, :6]
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        same_tokens = torch.equal(full.eval().generate(gen_ids, **kwargs), sharded.eval().generate(gen_ids, **kwargs))
    sharded.train()
    torch.manual_seed(3)
    with torch.no_grad():
        y = verify.main_output(sharded(**{k: v.to(device) for k, v in verify.case_inputs(ref, index, full).items()}))
    everyone = [torch.empty_like(y) for _ in range(ws)]
    dist.all_gather(everyone, y.contiguous())
    agree = all(torch.equal(everyone[0], o) for o in everyone)
    sharded.eval()
    timings = {}
    for name, model in (("full", full.eval()), ("sharded", sharded)):
        with torch.no_grad():
            for _ in range(3):
                model(**inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                model(**inputs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - t0) / 10 * 1e3
    return {"device": str(next(sharded.parameters()).device), "fwd_rel": fwd / scale, "grad_rel": worst,
            "same_tokens": same_tokens, "dropout_ranks_agree": agree, "ms_full": timings["full"],
            "ms_sharded": timings["sharded"]}


def _time_all_reduce(x: torch.Tensor, symm: bool, rounds: int = 200) -> float:
    """Microseconds per all-reduce of x (a fresh copy each call, as the engine's backward hooks make)."""
    import os

    import torch.distributed as dist

    from tpmap.engine.collectives import all_reduce_

    os.environ["TPMAP_SYMM_MEM"] = "1" if symm else "0"
    copies = [x.clone() for _ in range(rounds)]
    for t in copies[:10]:
        all_reduce_(t, None)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for t in copies:
        all_reduce_(t, None)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds * 1e6


def rank_symm_mem(sizes_kib: list[int]) -> dict:
    """On NCCL ranks, one GPU each: NCCL against TPMAP_SYMM_MEM=1 (engine.symm_mem)."""
    import os

    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import tpmap
    from tpmap.engine import symm_mem
    from tpmap.engine.collectives import all_reduce_

    device, ws = torch.device("cuda", torch.cuda.current_device()), dist.get_world_size()
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for kib in sizes_kib:
            g = torch.Generator(device=device).manual_seed(dist.get_rank())
            x = torch.randn(kib * 1024 // dtype.itemsize, device=device, generator=g).to(dtype)
            os.environ["TPMAP_SYMM_MEM"] = "0"
            nccl = all_reduce_(x.clone(), None)
            os.environ["TPMAP_SYMM_MEM"] = "1"
            took = symm_mem.for_group(x, None) is not None
            symm = all_reduce_(x.clone(), None)
            everyone = [torch.empty_like(symm) for _ in range(ws)]
            dist.all_gather(everyone, symm)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "kib": kib, "symm_taken": took,
                         "ranks_agree": all(torch.equal(everyone[0], e) for e in everyone),
                         "rel_vs_nccl": ((symm.float() - nccl.float()).abs().max() / nccl.float().abs().max()).item(),
                         "us_nccl": _time_all_reduce(x, False), "us_symm": _time_all_reduce(x, True)})
    cfg = AutoConfig.for_model("llama", hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                               intermediate_size=1024, num_hidden_layers=4, vocab_size=1024, initializer_range=0.1)
    torch.manual_seed(0)
    cpu_model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    model = tpmap.apply(cpu_model, ws).to(device).eval()
    out = {}
    for switch in ("0", "1"):
        os.environ["TPMAP_SYMM_MEM"] = switch
        with torch.no_grad():
            out[switch] = (model(ids).logits.float(),
                           model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0))
    os.environ["TPMAP_SYMM_MEM"] = "0"
    logits_rel = ((out["1"][0] - out["0"][0]).abs().max() / out["0"][0].abs().max()).item()
    return {"rows": rows, "logits_rel": logits_rel, "same_tokens": torch.equal(out["0"][1], out["1"][1]),
            "table": _speed_table(device, ws)}


def _slowest(fn, device, rounds: int = 10, warmup: int = 3) -> float:
    """The median over `rounds` of fn's time on the slowest rank (CUDA synchronized around each call; the same code
    runs on CPU ranks, where it can be tried without a GPU)."""
    import statistics

    import torch.distributed as dist

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + rounds):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        took = torch.tensor([time.perf_counter() - t0], device=device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(took.item())
    return statistics.median(times)


def _speed_table(device, ws: int) -> dict:
    """{task: {variant: seconds}}: floor.py's Llama in bf16, unsharded on every rank's GPU and tpmap on NCCL, then
    with TPMAP_SYMM_MEM=1."""
    import os

    import transformers
    from floor import CONFIG, NEW_TOKENS, VOCAB

    import tpmap

    torch.manual_seed(0)
    cpu_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    full = copy.deepcopy(cpu_model).to(device, torch.bfloat16)
    sharded = tpmap.apply(cpu_model, ws).to(device, torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = {shape: torch.randint(0, VOCAB, shape, generator=gen).to(device)
              for shape in ((1, 8), (4, 128), (1, 16))}
    tasks = {"forward 1x8": lambda m: m(inputs[(1, 8)]), "forward 4x128": lambda m: m(inputs[(4, 128)]),
             f"decode {NEW_TOKENS} tokens": lambda m: m.generate(inputs[(1, 16)], max_new_tokens=NEW_TOKENS,
                                                                min_new_tokens=NEW_TOKENS, do_sample=False)}
    table = {}
    with torch.no_grad():
        for task, run in tasks.items():
            row = table[task] = {}
            row["unsharded"] = _slowest(lambda run=run: run(full), device)
            for switch, name in (("0", "tpmap NCCL"), ("1", "tpmap symm-mem")):
                os.environ["TPMAP_SYMM_MEM"] = switch
                row[name] = _slowest(lambda run=run: run(sharded), device)
    os.environ["TPMAP_SYMM_MEM"] = "0"
    return table


def print_table(tables: dict[int, dict]) -> None:
    """The GPU table, markdown, one row per world size and task."""
    if not tables:
        return
    names = ["unsharded", "tpmap NCCL", "tpmap symm-mem"]
    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"\n{where}, bf16, latency.py's 170 M Llama shape, medians, slowest rank")
    print("| ws | task | " + " | ".join(names) + " | NCCL / unsharded | symm-mem / unsharded |")
    print("|---|---|" + "---|" * (len(names) + 2))
    for ws, table in tables.items():
        for task, row in table.items():
            print(f"| {ws} | {task} | " + " | ".join(f"{1e3 * row[n]:.2f} ms" for n in names)
                  + f" | {row['tpmap NCCL'] / row['unsharded']:.2f} | {row['tpmap symm-mem'] / row['unsharded']:.2f} |")


def check_symm_mem(world_sizes: list[int], tables: dict[int, dict], required: bool) -> int:
    """The NCCL part at every world size with a GPU per rank; fills `tables` (world size -> the GPU table's rows).
    Failures counted; finding no such world size is one only where `required` (--symm-mem asked for it)."""
    from tpmap.parallelize.rank_processes import RankFailure, Ranks, Setup, drain

    failed = checked = 0
    for ws in world_sizes:
        if torch.cuda.device_count() < ws:
            print(f"ws{ws} symm-mem: skipped, {torch.cuda.device_count()} GPU(s) here; NCCL needs one per rank",
                  flush=True)
            continue
        ranks = Ranks(ws, Setup(backend="nccl", devices=tuple(f"cuda:{r}" for r in range(ws)), threads=1,
                                collective_timeout=120))
        try:
            ranks.start(timeout=300)
            outcomes = drain(ranks.answers(ranks.submit(rank_symm_mem, [6, 32, 256, 1024]), 600, "symm-mem check"))
        except RankFailure as e:
            print(f"ws{ws} symm-mem: FAIL\n{e}", flush=True)
            failed += 1
            continue
        finally:
            ranks.stop()
        if not all(o.ok for o in outcomes):
            print(f"ws{ws} symm-mem: FAIL\n" + "\n".join(o.error for o in outcomes if not o.ok), flush=True)
            failed += 1
            continue
        r0, checked = outcomes[0].value, checked + 1
        for row in r0["rows"]:
            ok = row["symm_taken"] and row["ranks_agree"] and row["rel_vs_nccl"] < (1e-2 if row["dtype"] == "bfloat16"
                                                                                     else 1e-5)
            failed += not ok
            print(f"ws{ws} all-reduce {row['dtype']:8s} {row['kib']:5d} KiB: NCCL {row['us_nccl']:7.1f} us, "
                  f"symm-mem {row['us_symm']:7.1f} us ({row['us_nccl'] / row['us_symm']:.2f}x), ranks agree "
                  f"{row['ranks_agree']}, rel vs NCCL {row['rel_vs_nccl']:.1e}  {'ok' if ok else 'FAIL'}", flush=True)
        ok = r0["logits_rel"] < 1e-5 and r0["same_tokens"]
        failed += not ok
        print(f"ws{ws} llama logits symm-mem vs NCCL rel {r0['logits_rel']:.1e}, same tokens {r0['same_tokens']}  "
              f"{'ok' if ok else 'FAIL'}", flush=True)
        tables[ws] = r0["table"]
    if not checked and not failed:
        print("NCCL part: nothing checked, no world size had a GPU per rank", flush=True)
        return 1 if required else 0
    return failed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--symm-mem", action="store_true", help="the NCCL part only (one GPU per rank, 2+ GPUs)")
    parser.add_argument("--correctness-only", action="store_true", help="the cases only, no NCCL part")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}", flush=True)
    failed, tables = 0, {}
    if not args.symm_mem:
        failed += check_cases(args.world_sizes)
    if not args.correctness_only:
        failed += check_symm_mem(args.world_sizes, tables, required=args.symm_mem)
        print_table(tables)
    print(f"{'all ok' if not failed else f'{failed} failed'}")
    return 1 if failed else 0


def check_cases(world_sizes: list[int]) -> int:
    """gpt2, llama and t5 sharded on CUDA tensors (gloo ranks sharing the GPUs) against the unsharded model."""
    from tpmap.parallelize.rank_processes import RankFailure, RankPool

    failed = 0
    for ws in world_sizes:
        with RankPool(ws) as pool:
            for case in CASES:
                try:
                    per_rank = pool.run(rank_check, *case, timeout=300)
                except RankFailure as e:
                    print(f"ws{ws} {case[0]}: FAIL\n{e}", flush=True)
                    failed += 1
                    continue
                ok = all(r["fwd_rel"] < 1e-5 and r["grad_rel"] < 1e-3 and r["same_tokens"] and r["dropout_ranks_agree"]
                         for r in per_rank)
                failed += not ok
                r = per_rank[0]
                print(f"ws{ws} {case[0]:8s} {r['device']:7s} fwd {max(x['fwd_rel'] for x in per_rank):.1e} "
                      f"grad {max(x['grad_rel'] for x in per_rank):.1e} "
                      f"tokens {all(x['same_tokens'] for x in per_rank)} "
                      f"dropout-agree {all(x['dropout_ranks_agree'] for x in per_rank)} "
                      f"fwd ms full {r['ms_full']:.2f} sharded {r['ms_sharded']:.2f}  {'ok' if ok else 'FAIL'}",
                      flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
