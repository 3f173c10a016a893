"""Rank functions of tests/test_expert_parallel.py (run on every rank by the `ranks` fixture)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from checkpoint_cases import _CountReads

import tpmap


def load_parallel(folder: str, saved: str) -> dict:
    """from_pretrained(experts="parallel") of a transformers checkpoint (experts stored one tensor per expert):
    the logits and greedy tokens against transformers' unsharded load, the bytes this rank read, its experts'
    shapes; save_pretrained of the sharded model into `saved`."""
    full = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(0, full.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    with _CountReads() as reads:
        model = tpmap.from_pretrained(folder, experts="parallel").eval()
    with torch.no_grad():
        want, got = full(ids).logits, model(ids).logits
    tokens = (full.generate(ids[:1], max_new_tokens=6, do_sample=False),
              model.generate(ids[:1], max_new_tokens=6, do_sample=False))
    tpmap.save_pretrained(model, saved)
    dist.barrier()
    return {"rel": ((got - want).abs().max() / want.abs().max()).item(), "read": reads.bytes,
            "same_tokens": torch.equal(*tokens),
            "experts": {n: tuple(p.shape) for n, p in model.named_parameters() if ".experts." in n}}


def aux_loss(placement: str) -> dict:
    """Mixtral with its load-balancing loss in the loss (output_router_logits, coefficient 0.5), fp64, sharded with
    `placement` against the unsharded model: the auxiliary loss, the whole loss, and the routers' gradients (the
    auxiliary loss reaches them directly, beside the experts' terms)."""
    import copy

    from tpmap import verify

    full = verify.build_model("mixtral", 0, "MixtralForCausalLM").double()
    full.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    full.config.output_router_logits, full.config.router_aux_loss_coef = True, 0.5
    sharded = tpmap.apply(copy.deepcopy(full), dist.get_world_size(), experts=placement)
    ids = torch.randint(0, full.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    want, got = full(ids, labels=ids), sharded(ids, labels=ids)
    want.loss.backward()
    got.loss.backward()
    routers = {n: p.grad for n, p in full.named_parameters() if n.endswith("mlp.gate.weight")}
    local = dict(sharded.named_parameters())
    return {"aux": (want.aux_loss.item(), got.aux_loss.item()), "loss": (want.loss.item(), got.loss.item()),
            "router_rel": max(((local[n].grad - g).abs().max() / g.abs().max()).item() for n, g in routers.items()),
            "routers": len(routers)}
