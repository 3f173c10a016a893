"""`tpmap verify --model DIR [-n N]`: prove the mapping on the user's own checkpoint, with its real weights.

The checkpoint is sharded over N CPU workers (`tpmap.parallelize`, each loading only its own slices); the sharded
model's logits for a prompt and its greedy tokens are compared with the unsharded model's, loaded in this process
after the workers have stopped (so the peak is the larger of the two, not their sum). Both run in float32 by
default, whatever the checkpoint's dtype, so that a difference is the mapping's: in bfloat16 the per-rank partial
sums are rounded before the all-reduce, and a random 1.1B Llama's near-flat logits then differ by 2.7% and its
greedy tokens part after 3 (measured); ``--dtype bfloat16`` compares in that dtype all the same, with a looser
tolerance. The tolerance is verify's, relative to the largest logit: 1e-5 in float32, 2e-2 in bfloat16/float16.
It reports the peak resident memory of this process and of each worker, and refuses up front, with its estimate,
where the machine's available memory cannot hold the model (about 1.25x its weights in the compared dtype: the
unsharded model, or the N shards with their whole copies).
"""
from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tpmap.demo import PROMPT, prompt_ids
from tpmap.parallelize.handle import parallelize
from tpmap.plan_report import config_dtype, gib
from tpmap.tool_errors import WontFitError
from tpmap.verify import RTOL

HEADROOM = 1.25  # peak memory / weight files: the model plus activations, buffers and the Python heap
RTOL_HALF = 2e-2  # bf16/fp16 logits: 8 mantissa bits, sums in another order


def weight_bytes(folder: str) -> int:
    files = [p for p in Path(folder).iterdir() if p.suffix in (".safetensors", ".bin", ".pt")]
    return sum(p.stat().st_size for p in files)


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None elsewhere (then nothing is refused)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(folder: str, world_size: int, scale: float = 1.0) -> int:
    """The estimated peak in bytes (`scale`: compared / stored bytes per element); raises WontFitError naming it
    where the available memory is smaller."""
    # a dtype conversion holds the stored tensors beside the converted ones while loading: a 1.1B Llama stored in
    # bfloat16 (2.05 GiB) peaked at 6.51 GiB compared in float32 (4.1 GiB)
    need = int(weight_bytes(folder) * (scale if scale == 1 else scale + 1) * HEADROOM)
    have = available_bytes()
    if have is not None and need > have:
        raise WontFitError(
            f"{folder}: comparing needs about {need / 2**30:.1f} GiB ({HEADROOM}x the weight files: the unsharded "
            f"model in this process, or the {world_size} workers' shards with their whole copies), and this machine "
            f"has {have / 2**30:.1f} GiB available; free memory, or compare on a larger machine")
    return need


def _peak_rss(model) -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run(folder: str, world_size: int = 2, prompt: str = PROMPT, new_tokens: int = 16, out=None,
        dtype: torch.dtype = torch.float32) -> int:
    """Compare sharded and unsharded on the checkpoint in `folder`, both in `dtype`; print the report to `out`; 0 when
    the logits agree within the tolerance and the greedy tokens are equal, 1 otherwise. Raises WontFitError up
    front."""
    out = out or sys.stdout
    config = AutoConfig.from_pretrained(folder)
    need = check_fits(folder, world_size, dtype.itemsize / config_dtype(config).itemsize)
    ids, tokenizer = prompt_ids(folder, prompt)
    settings = dict(max_new_tokens=new_tokens, do_sample=False)
    with parallelize(folder, world_size, device="cpu", dtype=dtype) as sharded:
        pad = sharded.generation_config.pad_token_id
        settings["pad_token_id"] = pad if pad is not None else getattr(tokenizer, "pad_token_id", None)
        logits = sharded(ids).logits
        tokens = sharded.generate(ids, **settings)
        workers = sharded.run(_peak_rss)
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        want_logits = full(ids).logits
        want_tokens = full.generate(ids, **settings)
    dtype = want_logits.dtype
    tol = RTOL if dtype == torch.float32 else RTOL_HALF
    diff = (logits.float() - want_logits.float()).abs().max().item()
    rel = diff / max(want_logits.float().abs().max().item(), 1e-30)
    equal = tokens.shape == want_tokens.shape and torch.equal(tokens, want_tokens)
    ok = rel <= tol and equal
    print(f"{folder}: {config.model_type}, {world_size} CPU workers, {dtype}", file=out)
    print(f"logits    max|diff| {diff:.3g}, relative {rel:.3g} (tolerance {tol:g}): {'ok' if rel <= tol else 'FAIL'}",
          file=out)
    print(f"generate  greedy, up to {new_tokens} tokens: {'equal' if equal else 'DIFFER'}"
          f" (sharded {tokens[0, ids.shape[1]:].tolist()}, unsharded {want_tokens[0, ids.shape[1]:].tolist()})",
          file=out)
    peak = _peak_rss(None)
    print(f"memory    peak RSS: this process {gib(peak)}, workers {', '.join(map(gib, workers))} (estimated at most "
          f"{gib(need)} for the weights and their copies)", file=out)
    print(f"result: {'pass' if ok else 'FAIL'}", file=out)
    return 0 if ok else 1

