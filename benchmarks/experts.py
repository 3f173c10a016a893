"""Expert placement: experts="parallel" (whole experts per rank) vs "split" (every expert split along its width) vs
the unsharded model, interleaved in one run (rounds rotate the order; the first two are warm-up; each time is the
slowest rank's). fp32, 1 thread per rank. A Mixtral-shaped model: hidden 512, 6 layers, E experts of width I, top-2.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/experts.py 16 256   # many thin experts
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/experts.py 8 1024

2026-12-07, this 2-core machine, ws 2 (one run each; tpmap / unsharded):
E=16 I=256:  fwd 1x8 split 0.82, parallel 0.81; fwd 4x128 0.61 / 0.66; decode 0.91 / 0.98; train 0.55 / 0.62
E=8 I=1024:  fwd 1x8 split 0.67, parallel 0.75; fwd 4x128 0.57 / 0.67; decode 0.79 / 0.87; train 0.50 / 0.59
Split wins on CPU at ws 2 at both shapes: with whole experts the slowest rank is the one whose experts drew more
tokens this step, while split experts give every rank an equal share of every expert's work."""
import copy, statistics, sys, time, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist, transformers
import tpmap
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
E, I = int(sys.argv[1]), int(sys.argv[2])
cfg = transformers.AutoConfig.for_model("mixtral", hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                                        num_key_value_heads=8, intermediate_size=I, num_local_experts=E,
                                        num_experts_per_tok=2, vocab_size=8000, max_position_embeddings=512)
torch.manual_seed(0)
full = transformers.MixtralForCausalLM(cfg).eval()
models = {"unsharded": full,
          "split": tpmap.apply(copy.deepcopy(full), ws, experts="split").eval(),
          "parallel": tpmap.apply(copy.deepcopy(full), ws, experts="parallel").eval()}
def fwd(m, shape):
    ids = torch.randint(0, 8000, shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        m(ids)
def decode(m):
    ids = torch.randint(0, 8000, (1, 16), generator=torch.Generator().manual_seed(1))
    m.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
def train(m):
    ids = torch.randint(0, 8000, (2, 128), generator=torch.Generator().manual_seed(1))
    m.train(); m(ids, labels=ids).loss.backward(); m.zero_grad(set_to_none=True); m.eval()
tasks = {"fwd 1x8": lambda m: fwd(m, (1, 8)), "fwd 4x128": lambda m: fwd(m, (4, 128)), "decode 16": decode,
         "train 2x128": train}
times = {(t, v): [] for t in tasks for v in models}
for rnd in range(7):
    for t, f in tasks.items():
        order = list(models)[rnd % 3:] + list(models)[:rnd % 3]
        for v in order:
            dist.barrier(); t0 = time.perf_counter(); f(models[v]); dt = time.perf_counter() - t0
            tt = torch.tensor([dt]); dist.all_reduce(tt, op=dist.ReduceOp.MAX); dt = tt.item()
            if rnd >= 2: times[(t, v)].append(dt)
if rank == 0:
    print(f"E={E} I={I} ws={ws}")
    for t in tasks:
        base = statistics.median(times[(t, "unsharded")])
        print(f"{t:12s}", "  ".join(f"{v}: {statistics.median(times[(t, v)]):.4f}s ({statistics.median(times[(t, v)])/base:.2f})" for v in models))
dist.destroy_process_group()
