"""Functions the sequence-parallelism tests run on every rank (tests/test_sequence_parallel.py). Each builds
the unsharded model, a plain-TP copy and a sequence-parallel copy in the same run and compares them."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from rank_cases import _grad_report, in_dtype, loss_kwargs, zero_dropout_

import tpmap
from tpmap import verify
from tpmap.engine.collectives import counting_collectives


def _weighted(y: torch.Tensor) -> torch.Tensor:
    """A loss for a model without labels (as rank_cases.loss_of, from an output already computed)."""
    return (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)).sum() / y.numel()


def _models(ref: str, class_name: str, dtype: torch.dtype = torch.float32):
    """(unsharded, plain TP, sequence-parallel), all from the same verify-config weights."""
    ws = dist.get_world_size()
    full = verify.build_model(ref, 0, class_name).to(dtype)
    tp = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref))
    sp = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref), sequence_parallel=True)
    return full, tp, sp


def _block_input_tokens(model, on=None) -> list:
    """Hooks that record the sequence length each block's hidden-state input has (the first argument): on the
    blocks of `model` (sharded by tpmap), or on the same-named modules of `on` (its unsharded twin)."""
    from tpmap.engine.blocks import block_prefixes

    plan = model.tpmap_plan
    base = model.get_submodule(plan.base_prefix[:-1]) if plan.base_prefix else model
    hooked = (on.get_submodule(plan.base_prefix[:-1]) if plan.base_prefix else on) if on is not None else base
    seen: list = []
    stacks: dict[str, list[str]] = {}
    columns = [m.name for m in plan.modules if m.style == "column"]
    for b in block_prefixes(base):  # an encoder-decoder has two stacks: each one's block 1 records
        if any(c.startswith(plan.base_prefix + b + ".") for c in columns):  # not Gemma 3n's AltUp lists
            stacks.setdefault(b.rpartition(".")[0], []).append(b)
    for blocks in stacks.values():
        name = (blocks[1:2] or blocks[:1])[0]  # block 1: between two blocks (ALBERT: its one, shared block)
        block = hooked.get_submodule(name)
        handle = block.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(
                (args[0] if args else next(iter(kwargs.values()))).shape[1]), with_kwargs=True)
        if on is not None:
            _HANDLES.append(handle)
    return seen


_HANDLES: list = []  # the hooks _block_input_tokens put on an unsharded twin, removed after its measurement


def _length_the_blocks_split(full, tp, declared: dict, seq: int, dtype: torch.dtype) -> int:
    """`seq` where some stack's blocks see `seq` tokens; else (a model that puts image features before the text,
    GIT: 16 patches and a CLS) the first text length from `seq` to seq + ws - 1 at which a stack's blocks hold a
    multiple of ws tokens, measured on the unsharded model, so that the case exercises the split."""
    ws = dist.get_world_size()
    for length in range(seq, seq + ws):
        try:
            inputs = verify.example_inputs(full, declared, seq=length)
        except tpmap.MissingInputError as e:
            if "token runs" not in str(e):
                raise
            continue
        seen = _block_input_tokens(tp, on=full)
        try:
            with torch.no_grad():
                full(**in_dtype(inputs, dtype))
        finally:
            while _HANDLES:
                _HANDLES.pop().remove()
        if length == seq and seq in seen:  # the blocks see the text as asked: a length that does not divide
            return seq  # is the caller's choice (the case that runs as plain TP)
        if any(t % ws == 0 for t in seen):  # a stack that splits (an image tower's own length is fixed)
            return length
    return seq


def _room_for_token_runs(model, declared: dict, seq: int) -> int:
    """`seq`, or the next length by steps of ws whose rows hold the declared token runs (image tokens) before the
    last row's padding: a multimodal config's image tokens may need more than the text families' lengths, and
    the length must stay a multiple of ws for the split to run."""
    ws = dist.get_world_size()
    for length in range(seq, seq + 64 * ws, ws):
        try:
            verify.example_inputs(model, declared, seq=length)
            return length
        except tpmap.MissingInputError as e:
            if "token runs" not in str(e):
                raise
    return seq


def _patch(config) -> tuple[int, int]:
    """(height, width) of a patch: `patch_size` is an int, or a pair (InternVL's tower)."""
    p = config.patch_size
    return (p, p) if isinstance(p, int) else tuple(p)


def _extra_tokens(model, dtype: torch.dtype) -> int:
    """How many tokens a vision model's embeddings add to its patches (a CLS token: 1; SigLIP: 0), measured
    on a one-patch image: the first hidden state's length less one."""
    c, (ph, pw) = getattr(model.config, "num_channels", 3), _patch(model.config)  # BLIP-2's tower: always 3
    with torch.no_grad():
        out = model(pixel_values=torch.zeros(1, c, ph, pw, dtype=dtype), interpolate_pos_encoding=True,
                    output_hidden_states=True)
    return out.hidden_states[0].shape[1] - 1


def grad_case(ref: str, class_name: str, dtype: torch.dtype = torch.float32, seq: int = 8, train: bool = False,
              checkpointing: bool = False, decoder_seq: int | None = None, hidden_states: bool = False) -> dict:
    """Logits and one backward of a transformers loss: SP against the unsharded model and against plain TP.
    `train`: train mode with dropout 0 (exercises the dropout-region hooks); `checkpointing` implies it.
    An encoder-decoder's decoder gets `decoder_seq` tokens (default: `seq`). `hidden_states`: the forward
    records every block's output (output_hidden_states=True), compared too, and the loss reads them all."""
    rank = dist.get_rank()
    full, tp, sp = _models(ref, class_name, dtype)
    declared = verify.resolve(ref).mapping.verify[0].inputs  # Whisper's input_features
    # a vision model: an image of seq - extra patches + the extra tokens: seq tokens. A tower whose verify config
    # declares its pixel_values already patchified, not as an image [B, C, H, W] (SigLIP2's [B, patches,
    # C * p * p]), and a captioner led by pixel_values that declares its input_ids (BLIP-2) take the declared
    # inputs below.
    patchified = "pixel_values" in declared and len(declared["pixel_values"].shape) != 4
    if full.main_input_name == "pixel_values" and not patchified and "input_ids" not in declared:
        c, (ph, pw) = getattr(full.config, "num_channels", 3), _patch(full.config)  # BLIP-2's tower: always 3
        n = seq - _extra_tokens(full, dtype)  # a CLS token (CLIP, ViT) or none (SigLIP)
        rows = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
        shape = (2, c, rows * ph, n // rows * pw)
        pixels = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        inputs, has_labels = {"pixel_values": pixels, "interpolate_pos_encoding": True}, False
    else:  # Whisper's input_features, a multimodal model's image inputs
        seq = _length_the_blocks_split(full, tp, declared, _room_for_token_runs(full, declared, seq), dtype)
        inputs = verify.example_inputs(full, declared, seq=seq)
        if "decoder_input_ids" in inputs:  # seq // 2 + 1 by default: the decoder's tokens split too
            gen = torch.Generator().manual_seed(2)
            inputs["decoder_input_ids"] = verify.place_ids(
                torch.randint(3, inputs["decoder_input_ids"].max().item() + 1, (2, decoder_seq or seq), generator=gen),
                verify.boundary_ids(full, (dist.get_world_size(),), decoder=True), gen)  # on the shard boundaries
        inputs, has_labels = loss_kwargs(full, in_dtype(inputs, dtype))
    seen, seen_tp = _block_input_tokens(sp), _block_input_tokens(tp)
    if train or checkpointing:
        for m in (full, tp, sp):
            zero_dropout_(m)
            m.train()
    if checkpointing:
        sp.gradient_checkpointing_enable()
    outs, recorded = {}, {}
    for key, model in (("full", full), ("tp", tp), ("sp", sp)):
        out = model(**inputs, **({"output_hidden_states": True} if hidden_states else {}))
        y = verify.main_output(out)
        outs[key] = y.detach()
        loss = out.loss if has_labels else _weighted(y)
        if hidden_states:  # every recorded block output, in order: hidden_states, encoder_/decoder_hidden_states
            recorded[key] = [h for k, v in out.items() if k.endswith("hidden_states") for h in v]
            loss = loss + sum(_weighted(h) for h in recorded[key])
        loss.backward()
    scale = outs["full"].abs().max().item()
    tp_grads = {n: p.grad for n, p in tp.named_parameters()}
    worst_tp = 0.0
    global_max = max(g.abs().max().item() for g in tp_grads.values() if g is not None)
    for n, p in sp.named_parameters():
        if p.grad is None or tp_grads[n] is None:
            assert (p.grad is None) == (tp_grads[n] is None), n
            continue
        denom = max(tp_grads[n].abs().max().item(), 1e-2 * global_max)
        worst_tp = max(worst_tp, (p.grad - tp_grads[n]).abs().max().item() / denom)
    report = _grad_report(full, sp, rank)
    return {"logits_vs_full": (outs["sp"] - outs["full"]).abs().max().item() / scale,
            "logits_vs_tp": (outs["sp"] - outs["tp"]).abs().max().item() / scale,
            "grad_vs_full": report["worst_rel"], "grad_worst": report["worst_name"], "checked": report["checked"],
            "grad_rels": report["rels"],
            "grad_vs_tp": worst_tp, "block1_tokens": seen, "block1_tokens_tp": seen_tp, "seq": seq,
            "hidden_states": len(recorded.get("sp", ())),
            "hidden_shapes_equal": [tuple(h.shape) for h in recorded.get("sp", ())]
            == [tuple(h.shape) for h in recorded.get("full", ())],
            "hidden_vs_full": max((((a - b).abs().max() / b.abs().max()).item() for a, b
                                   in zip(recorded.get("sp", ()), recorded.get("full", ())) if a.shape == b.shape),
                                  default=0.0)}


def generate_case(ref: str, class_name: str, prompt_len: int = 8, new_tokens: int = 12) -> dict:
    """Greedy generate, batch 2: the prefill (an encoder-decoder's encoder) runs split, the decode steps (T = 1)
    as plain TP. Decoder-only prompts are left-padded; a model whose main input is not input_ids (Whisper's
    input_features) generates from its verify config's example of that input."""
    full, tp, sp = _models(ref, class_name)
    pad = getattr(full.config, "pad_token_id", None)  # CodeGenConfig has none
    pad = pad if pad is not None else 0
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    if full.main_input_name == "input_ids":
        vocab = full.config.get_text_config().vocab_size  # Fuyu: text_config
        gen = torch.Generator().manual_seed(11)
        prompt = torch.randint(3, vocab, (2, prompt_len), generator=gen)
        mask = torch.ones_like(prompt)
        if not getattr(full.config, "is_encoder_decoder", False):
            mask[1, :3] = 0
        prompt = verify.place_ids(prompt, verify.boundary_ids(full, (dist.get_world_size(),)), gen, mask)
        prompt[mask == 0] = pad
        kwargs["attention_mask"] = mask
    else:
        declared = verify.resolve(ref).mapping.verify[0].inputs
        prompt = verify.example_inputs(full, declared, seq=prompt_len)[full.main_input_name]
    seen, seen_tp = _block_input_tokens(sp), _block_input_tokens(tp)
    want, plain, got = (m.generate(prompt, **kwargs) for m in (full, tp, sp))
    return {"same_as_full": torch.equal(want, got), "same_as_tp": torch.equal(plain, got),
            "block1_tokens": seen[:3], "block1_tokens_tp": seen_tp[:3]}


def collectives_case(ref: str, class_name: str, seq: int = 8) -> dict:
    """Collectives of one eval forward with and without SP (input check off)."""
    ws = dist.get_world_size()
    full = verify.build_model(ref, 0, class_name)
    inputs = verify.example_inputs(full, seq=seq)
    counts = {}
    for key, on in (("tp", False), ("sp", True)):
        model = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref), sequence_parallel=on,
                            check_inputs=False)
        with torch.no_grad(), counting_collectives() as c:
            model(**inputs)
        counts[key] = dict(c)
    return counts


def mixed_backward_case(ref: str, class_name: str) -> dict:
    """Forwards of a divisible and a non-divisible length in one backward must raise, not sum wrong."""
    ws = dist.get_world_size()
    full = verify.build_model(ref, 0, class_name)
    sp = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref), sequence_parallel=True)
    a = verify.example_inputs(full, seq=8)
    b = verify.example_inputs(full, seq=7)
    loss = verify.main_output(sp(**a)).square().mean() + verify.main_output(sp(**b)).square().mean()
    try:
        loss.backward()
    except tpmap.SequenceParallelError as e:
        return {"error": type(e).__name__, "message": str(e)}
    except RuntimeError as e:  # autograd may wrap it
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}


def dropout_case(ref: str, class_name: str, probe: str) -> dict:
    """Train mode with the config's dropout: every rank returns the same output (the last gather puts one
    sequence back together); the dropout module `probe` (on split tokens, after a Row) draws its own mask on
    each rank; activation checkpointing replays the masks (same gradients)."""
    ws = dist.get_world_size()
    full = verify.build_model(ref, 0, class_name)
    inputs = verify.example_inputs(full, seq=8)
    results, grads, masks = {}, [], []
    for checkpointing in (False, True):
        sp = tpmap.apply(copy.deepcopy(full), ws, mapping=verify.resolve(ref), sequence_parallel=True).train()
        if checkpointing:
            sp.gradient_checkpointing_enable()
        sp.get_submodule(probe).register_forward_hook(lambda m, a, out: masks.append((out == 0).contiguous()))
        torch.manual_seed(1234)  # the same seed on every rank, as a training script sets it
        out = verify.main_output(sp(**inputs))
        everyone = [torch.empty_like(out) for _ in range(ws)]
        dist.all_gather(everyone, out.detach().contiguous())
        results[f"ranks_agree_{checkpointing}"] = all(torch.equal(everyone[0], o) for o in everyone)
        out.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in sp.named_parameters() if p.grad is not None})
        with torch.no_grad():
            results[f"dropout_changed_output_{checkpointing}"] = not torch.allclose(
                out, verify.main_output(sp.eval()(**inputs)))
    results["checkpointing_same_grads"] = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    everyone = [torch.empty_like(masks[0]) for _ in range(ws)]
    dist.all_gather(everyone, masks[0])
    results["mask_shape"] = tuple(masks[0].shape)
    results["masks_differ"] = all(not torch.equal(everyone[0], m) for m in everyone[1:])
    return results


def refused_case(ref: str, class_name: str) -> dict:
    """apply(sequence_parallel=True) on a model it cannot run: the error, and the model left as it was.
    A refusal that only the input can show (hidden states not batch-first) comes at the first forward, with the
    verify config's declared inputs (a multimodal model's image path: a tower that packs the images into one
    sequence)."""
    from rank_cases import same_signature, state_signature

    model = verify.build_model(ref, 0, class_name)
    before = state_signature(model)
    try:
        sp = tpmap.apply(model, dist.get_world_size(), mapping=verify.resolve(ref), sequence_parallel=True)
    except tpmap.TpmapError as e:
        return {"error": type(e).__name__, "message": str(e), "at": "apply",
                "untouched": same_signature(before, state_signature(model))}
    try:
        declared = verify.resolve(ref).mapping.verify[0].inputs
        sp(**verify.example_inputs(sp, declared, seq=_room_for_token_runs(sp, declared, 8)))
    except tpmap.TpmapError as e:
        return {"error": type(e).__name__, "message": str(e), "at": "forward", "untouched": None}
    return {"error": None, "message": "", "at": None, "untouched": False}
