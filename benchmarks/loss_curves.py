"""Loss-curve parity over 100 optimizer steps: tpmap at tp 2 and 4 against the unsharded model, and against the
stored unsharded curves in benchmarks/loss_curves/<family>.json.

    python benchmarks/loss_curves.py [--families llama bert ...] [--tp 2 4] [--steps 100] [--update]

For each family: the tiny model a mapping embeds (tpmap.verify.build_model: its verify config, seed 0, large init
std 0.2, fp32), trained in train mode with every dropout at 0, AdamW (lr, weight decay 0.01) with 10 warm-up steps
and cosine decay (transformers.get_cosine_schedule_with_warmup), on a fixed data set: N_BATCHES distinct batches
(tpmap.verify.example_inputs, images included, each from its own seeded generator) cycled in order. The loss is
transformers' own (causal LM; masked LM for BERT, 15% of the tokens masked), recorded before each step.

Runs, each a fresh model: tp 1 in this process (one thread, as each rank has), the unsharded reference; tp 2 and 4
on real gloo ranks (tpmap.parallelize.rank_processes.RankPool), every rank reporting its own curve. Each run is
compared step by step, ``rel = |loss - loss_ref| / |loss_ref|``, with two references:

* `stored`: the curve in benchmarks/loss_curves/<family>.json (made at tp 1 by --update): a regression between
  releases (or a change of torch / transformers, or another machine) shows here;
* `fresh`: the tp 1 curve of this same invocation (the project's rule: prove against the unsharded model in the
  same run); a sharding bug shows here whatever the stored file says.

A run passes when both worst relative differences (over every step and every rank) are <= TOLERANCE. The table
gives, per family and tp, the worst step and the worst relative difference against each reference; exit status 1
when anything fails.

TOLERANCE = 1e-4 was chosen from measurement (docs/training.md, "Loss-curve parity over 100 steps"): a correct
sharded run's worst divergence over 100 fp32 steps was 3.2e-5 (LLaVA at tp 2; the text families <= 2.6e-6): a few
ulps of reordered sums per step, which AdamW's per-element normalization and 100 steps amplify. Planted bugs (a
replicated norm's gradient not summed, a learning rate 1% higher on one rank) moved the curves by 4e-3 to 1e-2.

Family options: sequence parallelism (tpmap.apply(..., sequence_parallel=True)), LoRA (plain PEFT at tp 1; at tp >
1 the same adapter, saved by PEFT from the same seed and loaded by tpmap.peft.from_pretrained, each rank its slices:
tpmap.peft.get_peft_model draws fresh adapters from its own seed, which plain PEFT cannot reproduce) and
torch.compile (backend aot_eager at every tp, as tests/compile_cases.py: dynamo's and AOT autograd's graphs run
without inductor, which was not tried here).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

STORE = Path(__file__).resolve().parent / "loss_curves"
TOLERANCE = 1e-4  # max relative loss difference at any step (see the module docstring)
STEPS, WARMUP = 100, 10
N_BATCHES, BATCH, SEQ = 16, 4, 16  # SEQ: divisible by every tp, so sequence parallelism splits every forward
SEED = 0  # the model's init (build_model); the batches use DATA_SEED + k
DATA_SEED = 1000
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Family:
    ref: str  # model type of a shipped mapping
    class_name: str
    verify_index: int = 0  # the mapping's verify config (its tiny config)
    tps: tuple[int, ...] = (2, 4)  # run by default (--tp overrides); all verified by the config (2 and 4)
    lr: float = 1e-3
    masked_lm: bool = False
    sequence_parallel: bool = False
    lora: bool = False
    compile: bool = False


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM"),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM"),  # experts split inside, q/k norms grad_allreduce
    "bert": Family("bert", "BertForMaskedLM", masked_lm=True),
    "llava": Family("llava", "LlavaForConditionalGeneration"),  # vision tower + projector + llama, with images
    # one run each (tp 2) for the training options; --tp 2 4 runs them at tp 4 too
    "llama_sp": Family("llama", "LlamaForCausalLM", tps=(2,), sequence_parallel=True),
    "llama_lora": Family("llama", "LlamaForCausalLM", tps=(2,), lora=True, lr=1e-2),  # only the adapters train
    "llama_compile": Family("llama", "LlamaForCausalLM", tps=(2,), compile=True),
}


# -- the data set and the training run (on every rank, or in this process at tp 1) --------------------------
def batches(family: Family, model) -> list[dict]:
    """N_BATCHES distinct batches with labels, each from its own seeded generator (the same on every rank)."""
    from tpmap import verify

    declared = verify.resolve(family.ref).mapping.verify[family.verify_index].inputs
    model = model.get_base_model() if family.lora else model  # (PEFT's forward hides the model's inputs)
    config = model.config
    out = []
    for k in range(N_BATCHES):
        inputs = verify.example_inputs(model, declared, batch=BATCH, seq=SEQ, seed=DATA_SEED + k, world_sizes=(2, 4))
        ids, mask = inputs["input_ids"], inputs["attention_mask"]  # (BATCH, SEQ) each
        if family.masked_lm:  # 15% of the unpadded tokens (at least one per row) become the mask id
            gen = torch.Generator().manual_seed(DATA_SEED + 100 + k)
            chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & (mask == 1)
            chosen[:, 1] = True
            mask_id = verify.spare_id(config, config.vocab_size, set())
            inputs["labels"] = ids.masked_fill(~chosen, -100)
            inputs["input_ids"] = ids.masked_fill(chosen, mask_id)
        else:  # next-token labels (the model shifts them); no loss on padding or image placeholders
            image = getattr(config, "image_token_index", getattr(config, "image_token_id", None))
            labels = ids.masked_fill(mask == 0, -100)
            inputs["labels"] = labels if image is None else labels.masked_fill(ids == image, -100)
        out.append(inputs)
    return out


def zero_dropout_(model: torch.nn.Module) -> None:
    """Every dropout probability (modules, float attributes, configs) to 0: train mode, deterministic."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for owner in (module, getattr(module, "config", None)):
            for key, value in list(vars(owner).items()) if owner is not None else []:
                if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                    setattr(owner, key, 0.0)


def lora_model(base):
    """Plain PEFT LoRA on `base` (wrapped in place), its init drawn from a fixed seed."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED + 1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0))


def build(family: Family, tp: int, folder: str | None):
    """The model to train: unsharded at tp 1, else tpmap-sharded over the default group (of tp ranks)."""
    import torch.distributed as dist

    import tpmap
    import tpmap.peft
    from tpmap import verify

    full = verify.build_model(family.ref, family.verify_index, family.class_name, seed=SEED)
    zero_dropout_(full)
    full.train()
    if tp == 1:
        return lora_model(full) if family.lora else full
    if family.lora:  # the adapter plain PEFT draws at tp 1, saved full-size and loaded in slices
        if dist.get_rank() == 0:
            lora_model(copy.deepcopy(full)).save_pretrained(folder)
        dist.barrier()
    model = tpmap.apply(full, tp, sequence_parallel=family.sequence_parallel)
    return tpmap.peft.from_pretrained(model, folder, is_trainable=True) if family.lora else model


def curve(name: str, tp: int, steps: int = STEPS, folder: str | None = None) -> dict:
    """Train family `name` for `steps` AdamW steps at tp `tp`; the loss before every step, and the seconds."""
    from transformers import get_cosine_schedule_with_warmup

    family = FAMILIES[name]
    torch._dynamo.reset()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # (PEFT's)
    model = build(family, tp, folder)
    data = batches(family, model)
    step = torch.compile(model, backend="aot_eager") if family.compile else model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=family.lr, weight_decay=0.01)
    schedule = get_cosine_schedule_with_warmup(opt, WARMUP, steps)
    torch.manual_seed(SEED)  # the same RNG state on every rank, as a training script seeds it (the input check)
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        loss = step(**data[i % N_BATCHES]).loss
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch._dynamo.reset()
    return {"losses": losses, "seconds": time.perf_counter() - start}


def unsharded_curve(name: str, steps: int) -> dict:
    """The tp 1 curve in this process, on one thread (a rank's setting: fewer reorderings of a matmul's sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return curve(name, 1, steps)
    finally:
        torch.set_num_threads(threads)


# -- comparing and storing ----------------------------------------------------------------------------------
def worst(curves: list[list[float]], reference: list[float]) -> tuple[int, float]:
    """(step, rel) of the largest |loss - ref| / |ref| over every step of every curve (inf when lengths differ or a
    loss is not finite: a NaN never passes)."""
    at, rel = 0, 0.0
    for losses in curves:
        if len(losses) != len(reference):
            return -1, math.inf
        for i, (got, want) in enumerate(zip(losses, reference)):
            r = abs(got - want) / abs(want) if math.isfinite(got) and math.isfinite(want) and want else math.inf
            if not r <= rel:
                at, rel = i, r
    return at, rel


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass  # not Linux: platform's name stands
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def record(name: str, losses: list[float], steps: int) -> dict:
    """The stored form of a tp 1 curve: the losses and everything needed to reproduce them."""
    import peft
    import transformers

    from tpmap import verify

    family = FAMILIES[name]
    spec = verify.resolve(family.ref).mapping.verify[family.verify_index]
    return {
        "family": name, **{k: v for k, v in asdict(family).items() if k != "tps"},
        "verify_config": spec.name, "config": spec.config,
        "training": {"steps": steps, "optimizer": "AdamW", "lr": family.lr, "weight_decay": 0.01,
                     "schedule": f"linear warmup {WARMUP} steps, cosine decay", "batches": N_BATCHES,
                     "batch": [BATCH, SEQ], "dtype": "float32", "init_std": verify.INIT_STD, "dropout": 0.0},
        "seed": SEED, "data_seed": DATA_SEED, "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "date": datetime.date.today().isoformat(), "machine": machine(),
        "losses": losses,  # json writes repr floats: read back bit for bit
    }


def stored(name: str) -> list[float] | None:
    path = STORE / f"{name}.json"
    return json.loads(path.read_text())["losses"] if path.is_file() else None


# -- the check --------------------------------------------------------------------------------------------
@dataclass
class Row:
    family: str
    tp: int
    stored: tuple[int, float] | None  # (worst step, rel) against the stored curve; None: no stored curve
    fresh: tuple[int, float] | None  # against this invocation's tp 1 curve; None at tp 1
    seconds: float
    error: str = ""

    @property
    def passed(self) -> bool:
        """Within TOLERANCE of the stored curve (which must exist) and, at tp > 1, of the fresh tp 1 curve."""
        within = [c is not None and c[1] <= TOLERANCE for c in (self.stored, self.fresh if self.tp > 1 else (0, 0))]
        return not self.error and all(within)


def check(names: list[str], tps: list[int] | None, pools, steps: int = STEPS, log=print) -> list[Row]:
    """Every family's tp 1 curve in this process and its curves at `tps` (None: the family's own `tps`) on
    `pools(tp)` (a RankPool of tp ranks), each compared with the stored and the fresh tp 1 curve."""
    from tpmap.parallelize.rank_processes import RankFailure

    rows = []
    for name in names:
        ref = unsharded_curve(name, steps)
        want = stored(name)
        rows.append(Row(name, 1, None if want is None else worst([ref["losses"]], want), None, ref["seconds"]))
        log(table_line(rows[-1]))
        for tp in FAMILIES[name].tps if tps is None else tps:
            with tempfile.TemporaryDirectory() as folder:
                try:
                    per_rank = pools(tp).run(curve, name, tp, steps, folder, timeout=900)
                except RankFailure as e:
                    rows.append(Row(name, tp, None, None, 0.0, e.summary()))
                    log(table_line(rows[-1]))
                    continue
            curves = [r["losses"] for r in per_rank]
            rows.append(Row(name, tp, None if want is None else worst(curves, want), worst(curves, ref["losses"]),
                            max(r["seconds"] for r in per_rank)))
            log(table_line(rows[-1]))
    return rows


HEADER = (f"{'family':<14} {'tp':>2} {'vs stored: step':>15} {'rel':>9} {'vs fresh tp 1: step':>19} {'rel':>9} "
          f"{'train s':>8}  result")


def table_line(row: Row) -> str:
    def cells(c, width):
        return f"{'-':>{width}} {'-':>9}" if c is None else f"{c[0]:>{width}} {c[1]:>9.2e}"

    line = (f"{row.family:<14} {row.tp:>2} {cells(row.stored, 15)} {cells(row.fresh, 19)} {row.seconds:>8.1f}  "
            f"{'pass' if row.passed else 'FAIL'}")
    if row.tp == 1 and row.stored is None and not row.error:
        line += " (no stored curve: run with --update)"
    return line + (f"\n    {row.error}" if row.error else "")


def update(names: list[str], steps: int) -> None:
    STORE.mkdir(exist_ok=True)
    for name in names:
        result = unsharded_curve(name, steps)
        path = STORE / f"{name}.json"
        path.write_text(json.dumps(record(name, result["losses"], steps), indent=1) + "\n")
        print(f"{path}: {steps} steps, loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f} "
              f"({result['seconds']:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--tp", type=int, nargs="+", default=None, choices=[2, 4],
                        help="tensor-parallel sizes (default: 2 and 4, the training options at 2 only)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--update", action="store_true", help="rewrite the stored curves (tp 1 only)")
    args = parser.parse_args()
    if args.update:
        update(args.families, args.steps)
        return
    from tpmap.parallelize.rank_processes import RankPool

    pools: dict[int, RankPool] = {}
    start = time.perf_counter()
    print(f"loss-curve parity, {args.steps} steps, tolerance {TOLERANCE:g} (max |loss - ref| / |ref| over the steps)")
    print(HEADER)
    try:
        rows = check(args.families, args.tp, lambda tp: pools.setdefault(tp, RankPool(tp)), args.steps)
    finally:
        for pool in pools.values():
            pool.close()
    failed = [r for r in rows if not r.passed]
    print(f"{len(rows) - len(failed)} of {len(rows)} runs pass ({time.perf_counter() - start:.0f} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
