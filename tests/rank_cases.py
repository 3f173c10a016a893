"""Functions the tests run on every rank of a RankPool (importable by name in the rank processes).
Each one computes the unsharded reference itself, in the same run, and returns plain data."""
from __future__ import annotations

import copy
import dataclasses
import time

import torch
import torch.distributed as dist
import transformers

import tpmap
from tpmap import verify


def state_signature(model: torch.nn.Module) -> dict:
    """Everything a failed apply must leave untouched: names, shapes, values, module classes, config."""
    return {
        "params": {k: (tuple(v.shape), v.detach().clone()) for k, v in model.state_dict().items()},
        "classes": {n: type(m).__name__ for n, m in model.named_modules()},
        "config": model.config.to_dict(),
    }


def same_signature(a: dict, b: dict) -> bool:
    return (
        a["classes"] == b["classes"]
        and a["config"] == b["config"]
        and a["params"].keys() == b["params"].keys()
        and all(a["params"][k][0] == b["params"][k][0] and torch.equal(a["params"][k][1], b["params"][k][1])
                for k in a["params"])
    )


def apply_error(ref: str, class_name: str, world_size: int | None, mapping_text: str | None = None,
                twice: bool = False, loss_parallel: bool = False) -> dict:
    """apply() that is expected to fail: the error type/message, and whether the model stayed as it was."""
    model = verify.build_model(ref, 0, class_name)
    mapping = None
    if mapping_text is not None:
        from tpmap.language.source import load_text
        mapping = load_text(mapping_text, "<test mapping>")
    if twice:
        tpmap.apply(model, dist.get_world_size(), mapping=mapping)
    before = state_signature(model)
    try:
        tpmap.apply(model, world_size, mapping=mapping, loss_parallel=loss_parallel)
    except ValueError as e:
        return {"error": type(e).__name__, "message": str(e),
                "untouched": same_signature(before, state_signature(model))}
    return {"error": None, "message": "", "untouched": same_signature(before, state_signature(model))}


def crash_on_rank(rank_to_fail: int) -> int:
    if dist.get_rank() == rank_to_fail:
        raise RuntimeError(f"deliberate failure on rank {rank_to_fail}")
    return dist.get_rank()


def hang_unless_rank0() -> int:
    """Rank 0 returns; the others wait in an all-reduce that rank 0 never joins."""
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def rank_and_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def sleep_then_rank(seconds: float) -> int:
    time.sleep(seconds)
    return dist.get_rank()


def untouched_after_failed_apply_in_group(ref: str, class_name: str) -> dict:
    """A world size different from the group's must fail before anything changes."""
    return apply_error(ref, class_name, dist.get_world_size() + 1)


def gather_output_case() -> float:
    """A Column with gather_output on fused [q|k|v] returns the full output in the original order."""
    loaded = verify.resolve("gpt2")
    entries = list(loaded.mapping.entries)
    entries[0] = entries[0].model_copy(update={"gather_output": True})
    loaded = dataclasses.replace(loaded, mapping=loaded.mapping.model_copy(update={"entries": entries}))
    full = verify.build_model("gpt2", 0, "GPT2LMHeadModel")
    sharded = tpmap.apply(copy.deepcopy(full), dist.get_world_size(), mapping=loaded)
    x = torch.randn(2, 5, full.config.n_embd, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = full.transformer.h[0].attn.c_attn(x)
        got = sharded.transformer.h[0].attn.c_attn(x)
    return (want - got).abs().max().item()


def uneven_gather_output_case(n_head: int) -> dict:
    """GPT-2's fused c_attn (Conv1D, [q | k | v] of n_head heads) as a Column with gather_output, in fp64: its
    output, the input's gradient and this rank's weight and bias gradients against the unsharded module's
    (sliced by tests/slicing_reference.py). With n_head heads that the world size does not divide, ranks hold
    different widths: each pads its output to the widest before the all-gather, and the gather puts the
    features back in order."""
    import slicing_reference as ref
    ws, rank = dist.get_world_size(), dist.get_rank()
    loaded = verify.resolve("gpt2")
    entries = [loaded.mapping.entries[0].model_copy(update={"gather_output": True})]  # c_attn alone
    loaded = dataclasses.replace(loaded, mapping=loaded.mapping.model_copy(update={"entries": entries,
                                                                                   "uneven": True}))
    config = verify.tiny_config("gpt2", 0)
    config.n_head, config.n_embd, config.n_layer = n_head, 8 * n_head, 1
    torch.manual_seed(0)
    full = transformers.GPT2LMHeadModel(config).double()
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.2)
    sharded = tpmap.apply(copy.deepcopy(full), ws, mapping=loaded)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, config.n_embd, generator=generator, dtype=torch.float64)
    w = torch.randn(2, 5, 3 * config.n_embd, generator=generator, dtype=torch.float64)
    out = {}
    for name, model in (("full", full), ("sharded", sharded)):
        xi = x.clone().requires_grad_(True)
        y = model.transformer.h[0].attn.c_attn(xi)
        (y * w).sum().backward()
        out[name] = (y.detach(), xi.grad, model.transformer.h[0].attn.c_attn)
    (y_full, dx_full, c_full), (y, dx, c) = out["full"], out["sharded"]
    layout = ref.Layout(3 * config.n_embd, sections=tuple((config.n_embd, n_head) for _ in range(3)))
    want_w = ref.local_slice(c_full.weight.grad, 1, layout, ws, rank)  # Conv1D: [in, out]
    want_b = ref.local_slice(c_full.bias.grad, 0, layout, ws, rank)
    scale = y_full.abs().max().item()
    return {"widths": c.weight.shape[1], "y": (y - y_full).abs().max().item() / scale,
            "dx": (dx - dx_full).abs().max().item() / dx_full.abs().max().item(),
            "dw": (c.weight.grad - want_w).abs().max().item() / want_w.abs().max().item(),
            "db": (c.bias.grad - want_b).abs().max().item() / want_b.abs().max().item()}


def subclass_embedding_case(ref: str, verify_index: int, class_name: str) -> dict:
    """The input embedding is an nn.Embedding subclass with its own forward (a scaled lookup) and is
    split along the vocabulary: the sharded output equals the unsharded one, and the module keeps its
    class (so its forward) and its buffers, with this rank's rows only."""
    ws = dist.get_world_size()
    full = verify.build_model(ref, verify_index, class_name)
    inputs = verify.case_inputs(ref, verify_index, full)
    with torch.no_grad():
        want = verify.main_output(full(**inputs))
    sharded = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
    with torch.no_grad():
        got = verify.main_output(sharded(**inputs))
    before, after = full.get_input_embeddings(), sharded.get_input_embeddings()
    scale = getattr(before, "embed_scale", 1.0)
    return {"rel": (got - want).abs().max().item() / want.abs().max().item(),
            "original_class": type(before).__name__, "class": type(after).__name__,
            "keeps_class": isinstance(after, type(before)), "rows": after.weight.shape[0],
            "vocab": before.num_embeddings, "embed_scale": float(scale),
            "same_embed_scale": float(getattr(after, "embed_scale", 1.0)) == float(scale)}


# -- training and generation ---------------------------------------------------------------------
def zero_dropout_(model: torch.nn.Module) -> None:
    """Make train mode deterministic: every dropout probability (modules, attributes, configs) to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(module, key, 0.0)
        config = getattr(module, "config", None)
        for key in list(vars(config)) if config is not None else []:
            if ("dropout" in key or "pdrop" in key) and isinstance(getattr(config, key), float):
                setattr(config, key, 0.0)


def loss_kwargs(model: torch.nn.Module, inputs: dict) -> tuple[dict, bool]:
    """Inputs with transformers labels (causal-LM, masked-LM, seq2seq or classification loss) where the
    model takes them; False when the loss has to be made from the output instead."""
    inputs = dict(inputs)
    name = type(model).__name__
    if "SequenceClassification" in name:
        inputs["labels"] = torch.arange(inputs[model.main_input_name].shape[0]) % model.config.num_labels
        return inputs, True
    head = model.get_output_embeddings()
    if head is None:
        return inputs, False
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["labels"] = inputs.pop("decoder_input_ids")
    else:
        inputs["labels"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    # a token the head has no row for is no label (Mllama's embedding has 8 rows more than its LM head)
    rows = getattr(head, "out_features", None) or head.weight.shape[0]
    inputs["labels"] = inputs["labels"].masked_fill(inputs["labels"] >= rows, -100)
    return inputs, True


def in_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    """Floating-point inputs (Whisper's input_features) in the model's dtype; ids and masks unchanged."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def loss_of(model, inputs: dict, has_labels: bool) -> torch.Tensor:
    out = model(**inputs)
    if has_labels:
        return out.loss
    y = verify.main_output(out)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    return (y * weights).sum() / y.numel()


# Gradient noise floor, in units of the dtype's eps times the largest gradient of the parameter's module:
# some gradients are zero in exact arithmetic (a key bias shifts every score of a query equally, so
# softmax ignores it) and are rounding noise in both models (measured <= 8 eps of their module's scale).
GRAD_ATOL_EPS = 64


def _grad_report(full, sharded, rank: int, mapping=None) -> dict:
    """Every local gradient against the unsharded gradient, parameter by parameter; a split parameter's
    against the slice of the independent reference (tests/slicing_reference.py), not the engine's `take`.

    For each parameter p: err = max|got - want|, own = max|want| over this rank's elements, and an
    absolute floor atol = GRAD_ATOL_EPS * eps(dtype) * (largest |gradient| of p's module, weight and
    bias alike). ``rels`` holds each parameter's (err - atol) / own, ``worst_rel`` the largest:
    ``worst_rel <= rtol`` means every parameter has ``err <= rtol * own + atol``, so a small gradient
    is judged at its own scale (and a wrong one upstream of a wrong one may be the worst). Nothing
    is skipped: a gradient missing on one side counts as zeros. ``checked`` counts the parameters
    compared (all of them), ``sharded`` names those compared against a reference slice and
    ``expected_sharded`` the parameters the plan splits (the two must agree); ``reshaped`` names the
    parameters whose local shape differs from the full one (each must be a sharded one).
    """
    import slicing_reference

    plan = sharded.tpmap_plan
    ws = plan.tp_size
    loaded = mapping if mapping is not None else verify.resolve(plan.model_type)
    splits = slicing_reference.splits(full, loaded, plan, ws)
    full_params = dict(full.named_parameters(remove_duplicate=False))
    module_scale: dict[str, float] = {}
    for name, p in full_params.items():
        module = name.rpartition(".")[0]
        g = p.grad
        module_scale[module] = max(module_scale.get(module, 0.0), 0.0 if g is None else g.abs().max().item())
    worst, worst_name, checked, sharded_names, reshaped, rels = 0.0, "", 0, [], [], {}
    local = list(sharded.named_parameters())
    for name, p in local:
        source = full_params[name]
        if tuple(p.shape) != tuple(source.shape):
            reshaped.append(name)
        want = source.grad if source.grad is not None else torch.zeros_like(source)
        if name in splits:
            want = splits[name].local(want, ws, rank)
            if splits[name].dim is not None or splits[name].partial:
                sharded_names.append(name)
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        checked += 1
        if got.shape != want.shape or not (torch.isfinite(got).all() and torch.isfinite(want).all()):
            rel = float("inf")  # a NaN compares false with everything: never let it pass as "no difference"
        else:
            err = (got - want).abs().max().item() if want.numel() else 0.0
            own = want.abs().max().item() if want.numel() else 0.0
            atol = GRAD_ATOL_EPS * torch.finfo(want.dtype).eps * module_scale[name.rpartition(".")[0]]
            rel = 0.0 if err <= atol else (err - atol) / own if own > 0 else float("inf")
        rels[name] = rel
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
    names = {n for n, _ in local}
    expected = sorted({n for shard in plan.params.values() if shard.holder == "parameter" and (shard.dim is not None
                                                                                                 or shard.partial)
                       for n in (shard.name, *shard.aliases) if n in names})
    return {"worst_rel": worst, "worst_name": worst_name, "checked": checked, "params": len(local),
            "sharded": sorted(sharded_names), "expected_sharded": expected, "reshaped": sorted(reshaped), "rels": rels}


def _grad_setup(ref: str, verify_index: int, class_name: str, dtype: torch.dtype):
    """The unsharded model of a gradient check in `dtype`, in the mode its verify config asks, and its inputs."""
    full = verify.build_model(ref, verify_index, class_name).to(dtype)
    if dtype == torch.float64 and full._can_set_experts_implementation():
        full.set_experts_implementation("eager")  # grouped_mm (the fp32 default, tested there) has no fp64 kernel
    inputs, has_labels = loss_kwargs(full, in_dtype(verify.case_inputs(ref, verify_index, full), dtype))
    if verify.resolve(ref).mapping.verify[verify_index].grad_mode == "train":  # (the sharded copy inherits both)
        zero_dropout_(full)
        full.train()
    return full, inputs, has_labels


def reference_grads(ref: str, verify_index: int, class_name: str, dtype: torch.dtype = torch.float32) -> dict:
    """The unsharded model's loss and gradients (by parameter name), as grad_case computes them."""
    full, inputs, has_labels = _grad_setup(ref, verify_index, class_name, dtype)
    torch.manual_seed(7)
    loss = loss_of(full, inputs, has_labels)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in full.named_parameters()}}


def grad_case(ref: str, verify_index: int, class_name: str, checkpointing: bool = False,
              dtype: torch.dtype = torch.float32, reference: dict | None = None) -> dict:
    """One forward/backward of a transformers loss: every local gradient equals the unsharded slice.
    `reference`: the unsharded loss and gradients (reference_grads) computed on another rank of this case;
    by default this rank computes them."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    full, inputs, has_labels = _grad_setup(ref, verify_index, class_name, dtype)
    sharded = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
    if reference is None:
        torch.manual_seed(7)  # the same state for both forwards (and on every rank: the input check compares it)
        loss_full = loss_of(full, inputs, has_labels)
        loss_full.backward()
        reference = {"loss": loss_full.item()}
    else:
        for name, p in full.named_parameters():
            grad = reference["grads"][name]
            if grad is not None and grad.dtype != p.dtype:  # a module its forward casts (Switch's float32 router)
                p.data = p.data.to(grad.dtype)
            p.grad = grad
    torch.manual_seed(7)
    if checkpointing:  # HF checkpoints only in train mode: no dropout, so results stay comparable
        zero_dropout_(sharded)
        sharded.gradient_checkpointing_enable()
        sharded.train()
    loss_sharded = loss_of(sharded, inputs, has_labels)
    loss_sharded.backward()
    report = _grad_report(full, sharded, rank, verify.resolve(ref))
    report["loss_diff"] = abs(reference["loss"] - loss_sharded.item())
    report["loss"] = reference["loss"]
    return report


def adamw_case(ref: str, verify_index: int, class_name: str, steps: int = 3, init_std: float = 0.2,
               dtype: torch.dtype = torch.float64) -> dict:
    """`steps` AdamW steps on both models: the gathered sharded parameters equal the unsharded ones.

    In float64 by default: AdamW divides each gradient element by its own magnitude, so in fp32 the
    rounding noise of near-zero elements (~1e-7) becomes a parameter difference of ~1e-4 after one
    step in *any* reordering of the sums; in fp64 the same comparison is exact to ~1e-12."""
    ws = dist.get_world_size()
    full = verify.build_model(ref, verify_index, class_name, init_std=init_std).to(dtype)
    inputs, has_labels = loss_kwargs(full, in_dtype(verify.case_inputs(ref, verify_index, full), dtype))
    sharded = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
    losses = []
    for model in (full, sharded):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_of(model, inputs, has_labels)
            loss.backward()
            opt.step()
        losses.append(loss.item())
    gathered = tpmap.full_state_dict(sharded)
    want = full.state_dict()
    assert gathered.keys() == want.keys()
    diffs = {k: (gathered[k] - want[k]).abs().max().item() for k in want if want[k].is_floating_point()}
    worst = max(diffs, key=diffs.get)
    shapes_ok = all(gathered[k].shape == want[k].shape for k in want)
    return {"worst_abs": diffs[worst], "worst_name": worst, "shapes_ok": shapes_ok,
            "loss_diff": abs(losses[0] - losses[1]), "moved": max((want[k] - verify.build_model(
                ref, verify_index, class_name, init_std=init_std).to(dtype).state_dict()[k]).abs().max().item()
                                                                   for k in diffs)}


def dropout_case(ref: str, verify_index: int, class_name: str, attention_dropout: float | None = None) -> dict:
    """Train mode with dropout: replicated outputs identical on every rank; checkpointing replays masks;
    the attention-probability masks inside the sharded region differ between ranks (each rank's heads
    get their own mask, as slices of one full mask would). `attention_dropout`: set on every module that
    has the attribute (Llama's attention reads it at each forward; its config's default is 0)."""
    from tpmap.engine import rng

    ws = dist.get_world_size()
    full = verify.build_model(ref, verify_index, class_name)
    for module in full.modules():
        if attention_dropout is not None and hasattr(module, "attention_dropout"):
            module.attention_dropout = attention_dropout
    full.set_attn_implementation("eager")  # attention dropout through F.dropout, where it can be seen
    inputs = verify.case_inputs(ref, verify_index, full)
    results = {}
    grads, second_steps = [], []
    sharded_masks = []
    real_dropout = torch.nn.functional.dropout

    def recording_dropout(x, p=0.5, training=True, inplace=False):
        out = real_dropout(x, p, training, inplace)
        if training and p > 0 and rng.in_sharded_region() and not sharded_masks:
            sharded_masks.append((out == 0).contiguous())
        return out

    for checkpointing in (False, True):
        model = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.manual_seed(1234)  # the same seed on every rank, as a training script sets it
        torch.nn.functional.dropout = recording_dropout
        try:
            out = verify.main_output(model(**inputs))
        finally:
            torch.nn.functional.dropout = real_dropout
        everyone = [torch.empty_like(out) for _ in range(ws)]
        dist.all_gather(everyone, out.detach().contiguous())
        results[f"ranks_agree_{checkpointing}"] = all(torch.equal(everyone[0], o) for o in everyone)
        (out.float() ** 2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        # the replay in backward closed every region it opened (activation checkpointing stops a replay early,
        # at the last tensor it needs: inside a Row), so the next step's masks are those of a run without it
        results[f"open_after_backward_{checkpointing}"] = rng.in_sharded_region()
        torch.manual_seed(4321)
        second_steps.append(verify.main_output(model(**inputs)).detach())
        with torch.no_grad():
            eval_out = verify.main_output(model.eval()(**inputs))
        results[f"dropout_changed_output_{checkpointing}"] = not torch.allclose(out, eval_out)
    # relative to the largest gradient: the replay recomputes in fp32, where T5's large-init gradients differ by
    # rounding (1.2e-6 absolute); a mask not replayed changes them by their own size
    scale = max(g.abs().max().item() for g in grads[0].values())
    results["checkpointing_same_grads"] = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]) / scale
    results["checkpointing_same_second_step"] = ((second_steps[0] - second_steps[1]).abs().max()
                                                 / second_steps[0].abs().max()).item()  # relative
    mask = sharded_masks[0] if sharded_masks else torch.zeros(0, dtype=torch.bool)
    everyone = [torch.empty_like(mask) for _ in range(ws)]
    dist.all_gather(everyone, mask)
    results["sharded_masks_seen"] = mask.numel()
    results["sharded_masks_differ"] = all(not torch.equal(everyone[0], m) for m in everyone[1:])
    return results


def rng_region_case() -> dict:
    """The sharded-region generator differs per rank; the default stream stays in step across ranks."""
    from tpmap.engine import rng

    left_open = rng.in_sharded_region()  # by an earlier task on these ranks: enter would then be a no-op
    torch.manual_seed(5)
    before = torch.rand(4)
    rng.enter_sharded_region(dist.get_rank(), torch.device("cpu"))
    inside = torch.rand(4)
    rng.leave_sharded_region()
    after = torch.rand(4)
    gathered = {}
    for key, t in (("before", before), ("inside", inside), ("after", after)):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t)
        gathered[key] = len({tuple(p.tolist()) for p in parts})
    gathered["left_open"] = left_open
    return gathered


def region_after_error_case() -> dict:
    """A training forward that raises between a Column and its Row (in the attention, before o_proj) leaves
    no sharded region open, and the default streams of the ranks stay in step."""
    from tpmap.engine import rng

    model = tpmap.apply(verify.build_model("llama", 0, "LlamaForCausalLM"), dist.get_world_size()).train()

    def planted(*_):
        raise RuntimeError("planted")

    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(planted)
    torch.manual_seed(7)
    try:
        model(input_ids=torch.arange(8).view(1, 8))
    except RuntimeError as e:
        assert str(e) == "planted", e
    draw = torch.rand(4)
    parts = [torch.empty_like(draw) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, draw)
    return {"open": rng.in_sharded_region(), "streams": len({tuple(p.tolist()) for p in parts})}


def generate_case(ref: str, verify_index: int, class_name: str, cache: str | None = None,
                  new_tokens: int = 20, loss_parallel: bool = False, want: torch.Tensor | None = None) -> dict:
    """Greedy generate, batch 2: the same tokens as the unsharded model on every rank. Token prompts are
    left-padded (decoder-only); a model whose main input is not input_ids (Whisper's input_features)
    generates from its verify config's example of that input, and a verify config that declares other
    inputs (images: pixel_values, and input_ids holding their image tokens) generates from its example
    inputs, unpadded. `want`: the unsharded model's tokens (reference_generate) computed on another rank of this
    case; by default this rank generates them."""
    full, prompt, kwargs = _generate_setup(ref, verify_index, class_name, cache, new_tokens)
    ws = dist.get_world_size()
    if want is None:
        fresh = copy.deepcopy(full)  # before generate: RecurrentGemma keeps its cache states on its modules
        want = full.generate(prompt, **kwargs)
    else:
        fresh = full
    sharded = tpmap.apply(fresh, ws, mapping=verify.resolve(ref), loss_parallel=loss_parallel)
    got = sharded.generate(prompt, **kwargs)
    everyone = [torch.empty_like(got) for _ in range(ws)]
    dist.all_gather(everyone, got.contiguous())
    encoder_decoder = getattr(full.config, "is_encoder_decoder", False)
    return {"same_as_full": torch.equal(want, got), "ranks_agree": all(torch.equal(got, o) for o in everyone),
            "new_tokens": got.shape[1] - (0 if encoder_decoder else prompt.shape[1]),
            "tokens": got[:, -5:].tolist()}


def reference_generate(ref: str, verify_index: int, class_name: str, cache: str | None = None,
                       new_tokens: int = 20) -> torch.Tensor:
    """The unsharded model's greedy tokens, as generate_case computes them."""
    full, prompt, kwargs = _generate_setup(ref, verify_index, class_name, cache, new_tokens)
    return full.generate(prompt, **kwargs)


def _generate_setup(ref: str, verify_index: int, class_name: str, cache: str | None, new_tokens: int):
    """The unsharded model of a generate check, its prompt and generate's arguments (generate_case)."""
    ws = dist.get_world_size()
    full = verify.build_model(ref, verify_index, class_name)
    cfg = full.config
    encoder_decoder = getattr(cfg, "is_encoder_decoder", False)
    pad = getattr(cfg, "pad_token_id", None)  # CodeGenConfig has none
    pad = pad if pad is not None else 0
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    declared = verify.resolve(ref).mapping.verify[verify_index].inputs
    if full.main_input_name == "input_ids" and set(declared) - {"input_ids", "attention_mask"}:
        inputs = verify.case_inputs(ref, verify_index, full)
        prompt = inputs.pop("input_ids")
        kwargs.update(inputs, attention_mask=torch.ones_like(prompt))
    elif full.main_input_name == "input_ids":
        gen = torch.Generator().manual_seed(verify.stable_seed(f"{ref}/{verify_index}/generate"))
        prompt = torch.randint(3, cfg.get_text_config().vocab_size, (2, 7), generator=gen)  # Fuyu: text_config
        mask = torch.ones_like(prompt)
        if not encoder_decoder:
            mask[1, :3] = 0  # left padding
        prompt = verify.place_ids(prompt, verify.boundary_ids(full, (ws,)), gen, mask)  # prompts on shard boundaries
        prompt[mask == 0] = 0
        kwargs["attention_mask"] = mask
    else:
        inputs = verify.case_inputs(ref, verify_index, full)
        prompt = inputs.pop(full.main_input_name)
        if "input_ids" in declared:  # a captioner led by pixel_values (BLIP-2, InstructBLIP): its prompt and inputs
            kwargs.update(inputs)
    if cache is not None:
        kwargs["cache_implementation"] = cache
    return full, prompt, kwargs


def loss_parallel_case(ref: str, verify_index: int, class_name: str) -> dict:
    """loss_parallel: the loss on vocabulary-sharded logits equals the unsharded loss, and so do grads.

    Through ``labels=`` when the model routes its loss through transformers' loss_function; otherwise
    the model must refuse labels, and tpmap.vocab_parallel_cross_entropy on its logits gives the loss."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    full = verify.build_model(ref, verify_index, class_name)
    inputs, _ = loss_kwargs(full, verify.case_inputs(ref, verify_index, full))
    sharded = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref), loss_parallel=True)
    zero_dropout_(sharded)
    sharded.train()  # loss_parallel keeps the logits split in training mode
    out_full = full(**inputs)
    out_full.loss.backward()
    refusal = ""
    try:
        out = sharded(**inputs)
        loss, path, logits = out.loss, "labels", out.logits
    except tpmap.LossParallelError as e:
        refusal = str(e)
        labels = inputs.pop("labels")
        if getattr(full.config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = full.prepare_decoder_input_ids_from_labels(labels=labels)
        logits = sharded(**inputs).logits
        loss, path = tpmap.vocab_parallel_cross_entropy(sharded, logits, labels), f"explicit ({e.__class__.__name__})"
    loss.backward()
    return {"path": path, "refusal": refusal, "loss_diff": abs(loss.item() - out_full.loss.item()),
            "loss": out_full.loss.item(),
            "local_vocab": logits.shape[-1], "full_vocab": full.config.vocab_size,
            **_grad_report(full, sharded, rank, verify.resolve(ref))}


def mismatched_inputs_case(ref: str, class_name: str) -> dict:
    """Rank 1 gets other input ids: every rank raises InputMismatchError, none hangs."""
    ws = dist.get_world_size()
    model = tpmap.apply(verify.build_model(ref, 0, class_name), ws)
    inputs = verify.case_inputs(ref, 0, model)
    if dist.get_rank() == 1:
        inputs["input_ids"] = inputs["input_ids"].flip(0)
    try:
        model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=3,
                       do_sample=False, pad_token_id=0)
    except tpmap.InputMismatchError as e:
        return {"error": "InputMismatchError", "message": str(e)}
    return {"error": None, "message": ""}


def generate_check_cost(ref: str, class_name: str, new_tokens: int = 6) -> dict:
    """All-gathers in one greedy generate with the input check on and off: the check gathers once per call
    (not once per decode step). Then sampling with a different RNG state on rank 1 must be refused."""
    from tpmap.engine.collectives import counting_collectives

    ws = dist.get_world_size()
    full = verify.build_model(ref, 0, class_name)
    checked = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
    unchecked = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref), check_inputs=False)
    inputs = verify.case_inputs(ref, 0, full)
    kwargs = dict(attention_mask=inputs["attention_mask"], max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    counts, tokens = {}, {}
    for name, model in (("checked", checked), ("unchecked", unchecked)):
        with counting_collectives() as c:
            tokens[name] = model.generate(inputs["input_ids"], **kwargs)
        counts[name] = dict(c)
    torch.manual_seed(5 + dist.get_rank())  # sampling from different RNG states: tokens would differ
    try:
        checked.generate(inputs["input_ids"], **{**kwargs, "do_sample": True})
        sampling_error = None
    except tpmap.InputMismatchError as e:
        sampling_error = str(e)
    torch.manual_seed(5)
    checked.generate(inputs["input_ids"], **{**kwargs, "do_sample": True})  # the same state: runs
    forward_after = checked(**inputs).logits  # the per-forward check is back on after generate
    return {"counts": counts, "same_tokens": torch.equal(tokens["checked"], tokens["unchecked"]),
            "sampling_error": sampling_error, "paused_after": checked._forward_pre_hooks_with_kwargs != {},
            "logits_finite": bool(torch.isfinite(forward_after).all())}


def mismatched_main_input_case(ref: str, verify_index: int, class_name: str) -> dict:
    """Rank 1 gets other values of the model's main input (Whisper's input_features, passed
    positionally): every rank raises InputMismatchError; with the same inputs the forward runs."""
    ws = dist.get_world_size()
    model = tpmap.apply(verify.build_model(ref, verify_index, class_name), ws, mapping=verify.resolve(ref))
    inputs = verify.case_inputs(ref, verify_index, model)
    main = inputs.pop(model.main_input_name)
    with torch.no_grad():
        model(main, **inputs)  # same inputs everywhere: no error
        if dist.get_rank() == 1:
            main = main.flip(0)
        try:
            model(main, **inputs)
        except tpmap.InputMismatchError as e:
            return {"error": "InputMismatchError", "message": str(e)}
    return {"error": None, "message": ""}


def backward_all_reduce_count(ref: str, class_name: str) -> dict:
    """How many all-reduces one backward pass issues (the real collective, counted on the way through, on
    torch.distributed or the shared-memory path alike)."""
    from tpmap.engine.collectives import counting_collectives

    ws = dist.get_world_size()
    model = tpmap.apply(verify.build_model(ref, 0, class_name), ws)
    inputs, _ = loss_kwargs(model, verify.case_inputs(ref, 0, model))
    loss = model(**inputs).loss
    with counting_collectives() as counts:
        loss.backward()
    return {"calls": counts["all_reduce"], "layers": model.config.num_hidden_layers}


def post_apply_invariants(ref: str, class_name: str) -> dict:
    """What must hold after a *successful* apply: the shared config keeps the full sizes (so a saved
    config describes the original model), per-module config copies hold this rank's values, and the
    gathered state dict is the original one, name for name and bit for bit."""
    import tempfile

    from transformers import AutoConfig

    from tpmap.engine.planner import resolve_attr

    ws, rank = dist.get_world_size(), dist.get_rank()
    full = verify.build_model(ref, 0, class_name)
    original = full.config.to_dict()
    model = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
    plan = model.tpmap_plan
    copies = []
    for u in plan.updates:
        owner, _, value = resolve_attr(model.get_submodule(u.module), u.attribute)
        copies.append({"where": f"{u.module}.{u.attribute}", "per_rank": value == u.values[rank],
                       "own_copy": owner is not model.config if u.via_config else True})
    # each parallel Linear reports the widths it reads and returns, as nn.Linear does (a model's forward may
    # reshape by them): a tensor in_features wide goes in, one out_features wide comes out
    widths = []
    with torch.no_grad():
        for name, m in model.named_modules():
            if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear"):
                dtype = next(m.parameters()).dtype
                out = m(torch.ones(2, m.in_features, dtype=dtype))
                widths.append({"module": name, "in": m.in_features, "out": m.out_features, "got": out.shape[-1],
                               "gathers": getattr(m, "gather_output", False)})
    gathered = tpmap.full_state_dict(model)
    want = full.state_dict()
    saved = []
    for config in (model.config, full.config):  # a config round trip adds fields: compare like with like
        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            saved.append({k: v for k, v in AutoConfig.from_pretrained(tmp).to_dict().items() if k != "_name_or_path"})
    return {
        "shared_config_full": model.config.to_dict() == original,
        "saved_config_full": saved[0] == saved[1],
        "via_config_updates": sum(u.via_config for u in plan.updates),
        "copies_ok": all(c["per_rank"] and c["own_copy"] for c in copies),
        "bad_copies": [c for c in copies if not (c["per_rank"] and c["own_copy"])][:3],
        "state_names_equal": list(gathered) == list(want),
        "state_bit_equal": all(torch.equal(gathered[k], want[k]) for k in want),
        "local_smaller": sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in full.parameters()),
        "linears": len(widths),
        "gathering_linears": sum(w["gathers"] for w in widths),
        "bad_widths": [w for w in widths if w["got"] != w["out"]][:3],
    }


def partial_mapping_warnings(refs: list[str], class_names: list[str]) -> list[dict]:
    """Apply each (ref, class) in turn, twice for the first, recording the PartialMappingWarnings each apply
    emits on this rank (warnings reset to "always", so only tpmap's own once-per-mapping rule can hold
    them back) and the parameter share this rank keeps."""
    import warnings

    import tpmap.execute

    tpmap.execute._WARNED.clear()  # this worker process may have applied these mappings for earlier tests
    ws = dist.get_world_size()
    out = []
    for ref, class_name in [(refs[0], class_names[0])] + list(zip(refs, class_names)):
        full = verify.build_model(ref, 0, class_name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
        share = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in full.parameters())
        out.append({"ref": ref, "share": share,
                    "messages": [str(w.message) for w in caught
                                 if issubclass(w.category, tpmap.PartialMappingWarning)]})
    return out


def meta_apply_error(ref: str, class_name: str) -> dict:
    """apply on a model built on the meta device: a clear error before anything changes."""
    import transformers
    from transformers import AutoConfig

    mapping = verify.resolve(ref).mapping
    config = AutoConfig.for_model(mapping.model_type, **mapping.verify[0].config)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    try:
        tpmap.apply(model, dist.get_world_size())
    except tpmap.MetaDeviceError as e:
        return {"error": "MetaDeviceError", "message": str(e),
                "untouched": classes == {n: type(m).__name__ for n, m in model.named_modules()}}
    return {"error": None}


def out_of_step_case(kind: str) -> dict:
    """Rank 1 does something different from rank 0; every rank must raise InputMismatchError at once."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    model = tpmap.apply(verify.build_model("llama", 0, "LlamaForCausalLM"), ws)
    inputs = verify.case_inputs("llama", 0, model)
    try:
        if kind == "inputs_embeds":  # not a name the old check knew: any tensor argument counts now
            embeds = model.get_input_embeddings()(inputs["input_ids"]).detach()
            if rank == 1:
                embeds = embeds + 1e-3
            with torch.no_grad():
                model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])
        elif kind == "seed":  # training with another seed on rank 1: dropout masks would differ silently
            model.train()
            torch.manual_seed(1000 + (rank == 1))
            model(**inputs)
        elif kind == "max_new_tokens":
            model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], do_sample=False,
                           max_new_tokens=3 if rank == 1 else 5, pad_token_id=0)
    except tpmap.InputMismatchError as e:
        return {"error": "InputMismatchError", "message": str(e)}
    return {"error": None, "message": ""}


def unsharded_fp64_error(ref: str, verify_index: int, class_name: str) -> str | None:
    """The error the *unsharded* model raises in a float64 forward + backward (a mapping's verify config
    declares `not_checked: {grad_fp64: ...}` because transformers cannot run it: an exception, or a NaN
    loss or gradient), or None when it runs cleanly:
    then the declaration is stale and the test fails, asking to remove it."""
    full = verify.build_model(ref, verify_index, class_name).to(torch.float64)
    inputs, has_labels = loss_kwargs(full, in_dtype(verify.case_inputs(ref, verify_index, full), torch.float64))
    try:
        loss = loss_of(full, inputs, has_labels)
        loss.backward()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    bad = [n for n, p in full.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if not torch.isfinite(loss) or bad:
        return f"non-finite loss {loss.item()} or gradients ({len(bad)} tensors, e.g. {bad[:1]})"
    return None


def expected_share(ref: str, verify_index: int, class_name: str) -> dict:
    """What this rank should hold, from the unsharded model and the mapping, never from a sharded model:
    ``expected_local`` parameters (each split tensor's reference slice, tests/slicing_reference.py; the
    items of a ModuleList dealt out to other ranks absent; every other parameter whole), and
    ``whole_in_blocks``, the nn.Linear / Conv1D / nn.Embedding modules inside the repeated blocks that
    stay whole without a `replicated` pattern of the mapping keeping them so (a mapping that silently
    keeps most of a model whole still makes it smaller, and passes a plain `local < full`)."""
    import slicing_reference
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    from tpmap.engine.planner import base_prefix, composed
    from tpmap.language.patterns import match_modules

    ws, rank = dist.get_world_size(), dist.get_rank()
    full = verify.build_model(ref, verify_index, class_name)
    loaded = composed(full, verify.resolve(ref))  # a composing mapping's replicated patterns included
    plan = tpmap.plan(full, ws, mapping=loaded)
    splits = slicing_reference.splits(full, loaded, plan, ws)
    absent = []  # ModuleList items dealt to other ranks
    for name, split in splits.items():
        if split.dim is not None and isinstance(_get(full, name), nn.ModuleList):
            held = set(slicing_reference.held(split.layout, ws, rank))
            absent += [f"{name}.{i}." for i in range(split.layout.size) if i not in held]
    local = 0
    for name, p in full.named_parameters():
        if any(name.startswith(a) for a in absent):
            continue
        split = splits.get(name)
        local += split.local_numel(p.shape, ws, rank) if split is not None else p.numel()
    base_model, prefix = base_prefix(full)
    modules = dict(base_model.named_modules())
    lists: list[str] = []  # the outermost ModuleLists: their items are the repeated blocks
    for name, module in modules.items():
        if isinstance(module, nn.ModuleList) and name and not any(name.startswith(q + ".") for q in lists):
            lists.append(name)
    kept = {n for pattern in loaded.mapping.replicated_patterns for n in match_modules(pattern, modules)}
    whole = []
    for name, module in modules.items():
        parts = name.split(".")
        if (not isinstance(module, (nn.Linear, Conv1D, nn.Embedding))
                or not any(name.startswith(q + ".") for q in lists)
                or any(".".join(parts[:k]) in kept for k in range(1, len(parts) + 1))):
            continue
        split = splits.get(f"{prefix}{name}.weight")
        if split is None or (split.dim is None and not split.partial):
            whole.append(prefix + name)
    return {"expected_local": local, "full": sum(p.numel() for p in full.parameters()), "whole_in_blocks": whole}


def _get(model: torch.nn.Module, name: str):
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def prove_case(ref: str, verify_index: int, class_name: str, training: bool, generate: bool,
               grads: tuple[str, ...] = ("grad_fp32", "grad_fp64")) -> dict:
    """Everything CI proves for one (mapping, verify config, class) at this world size, in one round trip
    to the ranks: the forward against the unsharded model and this rank's expected parameter share
    (always); per-shard gradients (`grads` of grad_fp32 and grad_fp64) and greedy generate (dynamic cache)
    where asked. A grad_fp64 the config declares not_checked is proven failing on the unsharded model
    instead. The unsharded gradients and tokens are computed once between the ranks (shared_references),
    not on each."""
    not_checked = verify.resolve(ref).mapping.verify[verify_index].not_checked
    dtypes = {"grad_fp32": torch.float32, "grad_fp64": torch.float64}
    run = [k for k in grads if training and not (k == "grad_fp64" and k in not_checked)]
    jobs = {}  # the most expensive first, alone on rank 0
    if generate and "generate" not in not_checked:
        jobs["generate"] = lambda: reference_generate(ref, verify_index, class_name)
    for key in run:
        jobs[key] = lambda d=dtypes[key]: reference_grads(ref, verify_index, class_name, d)
    references = shared_references(jobs)
    out = {"forward": verify.forward_case(ref, verify_index, class_name),
           "share": expected_share(ref, verify_index, class_name)}
    for key in run:
        out[key] = grad_case(ref, verify_index, class_name, False, dtypes[key], reference=references[key])
    if training and "grad_fp64" in grads and "grad_fp64" in not_checked:
        out["grad_fp64_unsharded_error"] = unsharded_fp64_error(ref, verify_index, class_name)
    if generate and "generate" in not_checked:
        out["generate_unsharded_error"] = unsharded_generate_error(ref, verify_index, class_name)
    elif generate:
        out["generate"] = generate_case(ref, verify_index, class_name, None, want=references["generate"])
    return out


def shared_references(jobs: dict) -> dict:
    """Runs each job (name -> callable computing an unsharded reference) on one rank only and sends its
    result to every rank: the first job (the most expensive) on rank 0, the others dealt out over ranks 1..
    (so at world size 2 rank 1 runs all but the first). Every rank builds the same model from the same seed
    and inputs, so the result is the one it would compute itself; each rank still compares its own shard
    against it. A job that raises raises on every rank, naming the rank and the job (none is left waiting)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    owner = {name: 0 if i == 0 or ws == 1 else 1 + (i - 1) % (ws - 1) for i, name in enumerate(jobs)}
    mine = {}
    for name, job in jobs.items():
        if owner[name] == rank:
            try:
                mine[name] = (True, job())
            except Exception as e:  # sent to every rank below and raised there
                mine[name] = (False, f"{type(e).__name__}: {e}")
    out = {}
    for name in jobs:
        box = [mine.get(name)]
        dist.broadcast_object_list(box, src=owner[name])
        ok, value = box[0]
        if not ok:
            raise RuntimeError(f"the unsharded reference {name!r} failed on rank {owner[name]}: {value}")
        out[name] = value
    return out


def unsharded_generate_error(ref: str, verify_index: int, class_name: str) -> str | None:
    """The error the *unsharded* model's own greedy generate raises (declared `not_checked: {generate: ...}`),
    or None when it runs: then the declaration is stale and the test fails."""
    full = verify.build_model(ref, verify_index, class_name)
    ids = verify.case_inputs(ref, verify_index, full)["input_ids"]
    try:
        full.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def comm_counts(model_types: list[str]) -> list[dict]:
    """benchmarks/comm.py's measurement (collectives per forward and per step, and the Megatron minimum
    from the unsharded model's dataflow) for each model type, on this rank."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "comm.py"
    spec = importlib.util.spec_from_file_location("tpmap_bench_comm", path)
    comm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(comm)
    return [comm.row(comm.measure(t)) for t in model_types]
