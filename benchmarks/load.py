"""Loading a tensor-parallel model: `tpmap.from_pretrained` against transformers' `from_pretrained` +
`tpmap.apply`, per rank: peak RSS growth (anonymous and file-backed pages separately), wall time, bytes
read, and the bytes the rank keeps.

    python benchmarks/load.py [--models llama mixtral mixtral_stacked] [--world-sizes 1 2 4] [--dir /tmp] [--keep]
                              [--whole-conversions] [--tiny] [--experts split|parallel]

It writes random bf16 checkpoints as transformers' save_pretrained lays them out (sharded into several files;
Mixtral's experts as per-expert 2-D tensors, which loading fuses into 3-D parameters): a ~1.1 B-parameter Llama
shape (TinyLlama: hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632, vocabulary 32000) and a ~0.9 B Mixtral
shape (hidden 1024, 16 layers, 16 heads, 8 KV heads, 8 experts of MLP 2048; `mixtral_stacked`: the same with its
experts stored stacked, as the 3-D parameters). Every rank is a process of a gloo group; before the clock starts it
imports everything and loads a tiny checkpoint of the same model type the same way (so lazy imports are not
measured), then resets its peak RSS. While it loads, this process samples each rank's /proc/PID/status every 5 ms
(RssAnon, RssFile); the rank itself reports VmHWM (the kernel's peak, anonymous + file-backed), its wall time and
CPU time (user + system, all its threads: the machine may be shared), /proc/self/io's rchar (bytes passed through
read system calls: what tpmap reads; a memory-mapped read, transformers' way, shows up as file-backed RSS instead)
and the bytes of the tensors it keeps.

Target: peak growth <= 1.15 x kept + a fixed allowance (ALLOWANCE_MIB: the interpreter's own
churn while loading, measured on a tiny checkpoint). `--whole-conversions` measures tpmap's fallback for
conversions it cannot slice lazily (forced on for every converted tensor). The checkpoints (~2 GB
each) are deleted afterwards unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

ALLOWANCE_MIB = 64
MODELS = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                       num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                       max_position_embeddings=2048, tie_word_embeddings=False)),
    "mixtral": ("MixtralForCausalLM", dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=16,
                                           num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                           num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=2048,
                                           tie_word_embeddings=False)),
}
MODELS["mixtral_stacked"] = MODELS["mixtral"]  # the same model, its experts stored as the 3-D parameters themselves
STACKED = {"mixtral_stacked"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=256)


# -- writing a random checkpoint, laid out as transformers' save_pretrained lays it out ------------------
def write_checkpoint(folder: Path, class_name: str, overrides: dict, max_shard_size: str, stacked: bool = False) -> int:
    """A random bf16 checkpoint, one tensor in memory at a time; returns its tensor bytes. `stacked`: MoE experts
    stored as the model's 3-D parameters (gate_up_proj [E, 2I, H]), not per expert as save_pretrained writes them."""
    import transformers
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from tpmap.checkpoint.safetensors import SafetensorsWriter

    cls = getattr(transformers, class_name)
    config = AutoConfig.for_model(cls.config_class.model_type, **overrides)
    config.dtype = "bfloat16"
    config.architectures = [class_name]
    with torch.device("meta"):
        model = cls(config).to(torch.bfloat16)
    state = remove_tied_weights_from_state_dict(dict(model.state_dict()), model)
    if not stacked:
        state = revert_weight_conversion(model, state)  # per-expert tensors, as transformers saves them
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for file, names in split.filename_to_tensors.items():
        writer = SafetensorsWriter(folder / file, [(n, state[n].dtype, tuple(state[n].shape)) for n in names],
                                   {"format": "pt"})
        for n in names:
            value = (torch.rand(state[n].shape, generator=gen) * 0.04 - 0.02).to(state[n].dtype)
            writer.write(n, value)
        writer.close()
    if split.is_sharded:
        index = {"metadata": {"total_size": split.metadata["total_size"]}, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(folder)
    return sum(t.numel() * t.element_size() for t in state.values())


# -- one rank ----------------------------------------------------------------------------------------
def _status(pid: str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _load(method: str, folder: str, world_size: int, experts: str | None = None):
    import tpmap

    if method == "tpmap":
        return tpmap.from_pretrained(folder, dtype=torch.bfloat16, experts=experts)
    import transformers

    config = json.loads((Path(folder) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    return tpmap.apply(cls.from_pretrained(folder, dtype=torch.bfloat16), world_size, experts=experts)


def _rank(rank: int, world_size: int, port: int, method: str, folder: str, warm: str, whole: bool, phase, results,
          experts: str | None = None):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from tpmap.checkpoint import conversion

    conversion.LAZY_CONVERSIONS = not whole
    del_model = _load(method, warm, world_size, experts)  # imports and code paths warm; measured run below
    del del_model
    import gc

    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base, read0 = _status(), _rchar()
    phase.value = 1
    start, cpu = time.perf_counter(), time.process_time()
    model = _load(method, folder, world_size, experts)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    phase.value = 2
    end, read1 = _status(), _rchar()
    seen: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen.setdefault(id(t), t)
    kept = sum(t.numel() * t.element_size() for t in seen.values())
    results.put({"rank": rank, "seconds": seconds, "cpu": cpu, "base": base, "hwm": end["VmHWM"], "read": read1 - read0,
                 "kept": kept})
    dist.barrier()
    dist.destroy_process_group()


def measure(method: str, folder: Path, warm: Path, world_size: int, whole: bool = False,
            experts: str | None = None) -> list[dict]:
    """Run one load on `world_size` rank processes; per-rank numbers, peaks sampled from here."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ctx.Queue()
    phases = [ctx.Value("i", 0) for _ in range(world_size)]
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, method, str(folder), str(warm), whole, phases[r],
                                             results, experts)) for r in range(world_size)]
    for p in procs:
        p.start()
    peaks = [{"RssAnon": 0, "RssFile": 0, "sum": 0} for _ in procs]
    while any(p.is_alive() for p in procs) and any(ph.value < 2 for ph in phases):
        for r, p in enumerate(procs):
            if phases[r].value == 1:
                try:
                    st = _status(str(p.pid))
                except (FileNotFoundError, ProcessLookupError):
                    continue
                peaks[r]["RssAnon"] = max(peaks[r]["RssAnon"], st["RssAnon"])
                peaks[r]["RssFile"] = max(peaks[r]["RssFile"], st["RssFile"])
                peaks[r]["sum"] = max(peaks[r]["sum"], st["RssAnon"] + st["RssFile"])
        time.sleep(0.005)
    out = sorted((results.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process exited with {p.exitcode}")
    for r, res in enumerate(out):
        base = res["base"]
        res["anon"] = max(0, peaks[r]["RssAnon"] - base["RssAnon"])
        res["file"] = max(0, peaks[r]["RssFile"] - base["RssFile"])
        res["total"] = max(res["hwm"] - base["RssAnon"] - base["RssFile"], peaks[r]["sum"] - base["RssAnon"] -
                           base["RssFile"])
    return out


MiB = 1 << 20


def row(model: str, ws: int, method: str, per_rank: list[dict]) -> dict:
    worst = max(per_rank, key=lambda r: r["total"] / max(r["kept"], 1))
    return {"model": model, "ws": ws, "method": method, "kept": worst["kept"] / MiB, "anon": worst["anon"] / MiB,
            "file": worst["file"] / MiB, "total": worst["total"] / MiB,
            "ratio": worst["total"] / worst["kept"], "seconds": max(r["seconds"] for r in per_rank),
            "cpu": max(r["cpu"] for r in per_rank),
            "read": worst["read"] / MiB,
            "target": worst["total"] <= 1.15 * worst["kept"] + ALLOWANCE_MIB * MiB}


def render(rows: list[dict]) -> str:
    head = ("| model | ws | loader | kept/rank MiB | peak growth anon MiB | file-backed MiB | total MiB | total/kept "
            "| wall s | CPU s | read MiB | <= 1.15x kept + 64 MiB |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['model']} | {r['ws']} | {r['method']} | {r['kept']:.0f} | {r['anon']:.0f} "
                     f"| {r['file']:.0f} | {r['total']:.0f} | {r['ratio']:.2f}x | {r['seconds']:.1f} "
                     f"| {r['cpu']:.1f} | {r['read']:.0f} | "
                     f"{'yes' if r['target'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--loaders", nargs="+", default=["transformers+apply", "tpmap"],
                        choices=["transformers+apply", "tpmap"])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go (deleted after)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (in --dir/tpmap-load-checkpoints)")
    parser.add_argument("--reuse", action="store_true", help="reuse checkpoints kept by an earlier --keep run")
    parser.add_argument("--whole-conversions", action="store_true",
                        help="also measure tpmap with lazy conversion off (its fallback), for converted models")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test of this script)")
    parser.add_argument("--max-shard-size", default="500MB")
    parser.add_argument("--experts", choices=["split", "parallel"], help="the MoE experts' placement (default: the "
                        "mapping's)")
    args = parser.parse_args()

    rows = []
    root = Path(args.dir) / "tpmap-load-checkpoints"
    if not args.reuse:
        shutil.rmtree(root, ignore_errors=True)
    try:
        for name in args.models:
            class_name, shape = MODELS[name]
            if args.tiny:
                shape = {**shape, **TINY, **({"num_key_value_heads": 4} if "num_key_value_heads" in shape else {})}
            folder, warm = root / (name + ("-tiny" if args.tiny else "")), root / f"{name}-warm"
            if not (args.reuse and (warm / "config.json").is_file()):
                write_checkpoint(warm, class_name, {**shape, **TINY}, "50GB", name in STACKED)
            if not (args.reuse and (folder / "config.json").is_file()):
                write_checkpoint(folder, class_name, shape, args.max_shard_size, name in STACKED)
            size = sum(os.path.getsize(f) for f in folder.glob("*.safetensors"))
            files = len(list(folder.glob("*.safetensors")))
            print(f"# {name}: {size / MiB:.0f} MiB of tensors in {files} files ({class_name}, bf16)", flush=True)
            placed = f" experts={args.experts}" if args.experts and class_name.startswith("Mixtral") else ""
            loaders = [(m, (m if m == "tpmap" else "transformers+apply") + placed, False) for m in args.loaders]
            converted = name == "mixtral"
            if args.whole_conversions and converted:
                loaders.append(("tpmap", "tpmap, whole conversions", True))
            for ws in args.world_sizes:
                for method, label, whole in loaders:
                    per_rank = measure("tpmap" if method == "tpmap" else "hf", folder, warm, ws, whole,
                                       args.experts if placed else None)
                    rows.append(row(name, ws, label, per_rank))
                    print(render(rows[-1:]).splitlines()[-1], flush=True)
            if not args.keep:
                shutil.rmtree(folder)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(render(rows))


if __name__ == "__main__":
    main()
