"""LoRA through PEFT on real ranks (run by tests/test_lora.py): the sharded PEFT model against unsharded
PEFT in the same process, with the same adapter values sliced by the independent reference."""
from __future__ import annotations

import copy

import slicing_reference
import torch
import torch.distributed as dist
from peft import LoraConfig
from peft import get_peft_model as unsharded_peft_model
from rank_cases import in_dtype, loss_kwargs, loss_of

import tpmap
import tpmap.peft
from tpmap import verify

LORA = "lora_"
SP_SEQ = 12  # tokens of a sequence-parallel case: 2, 3 and 4 divide it


def _base_name(lora_name: str) -> tuple[str, str]:
    """'base_model.model.X.lora_A.default.weight' -> ('X.weight', 'A'); a ``modules_to_save`` copy's
    'base_model.model.X.modules_to_save.default.weight' -> ('X.weight', 'M')."""
    if ".modules_to_save." in lora_name:
        head, _, tail = lora_name.partition(".modules_to_save.")
        return f"{head.removeprefix('base_model.model.')}.{tail.partition('.')[2]}", "M"
    head, _, tail = lora_name.partition(".lora_")
    return head.removeprefix("base_model.model.") + ".weight", tail[0]


def _reference_slice(full_tensor, which: str, split, reverse: bool, ws: int, rank: int) -> torch.Tensor:
    """This rank's part of a full-size adapter tensor, cut by the base weight's reference split. A weight is
    (out, in), a Conv1D's (in, out): a Column splits out (B's rows), a Row in (A's columns), the other whole.
    A ``modules_to_save`` copy ("M") is cut like the tensor it copies."""
    if split is None or split.dim is None:
        return full_tensor
    if which == "M":
        return split.local(full_tensor, ws, rank)
    column = split.dim == (1 if reverse else 0)
    if (which == "B") != column:
        return full_tensor
    # B (out, r) and A (r, in) have the split dim where a (out, in) weight has it; transposed for a Conv1D
    local = split.local(full_tensor.T if reverse else full_tensor, ws, rank)
    return local.T if reverse else local


def _expert_slicer(full_peft, splits: dict):
    """For each LoRA tensor of a PEFT ParamWrapper in the unsharded model (``target_parameters``: MoE experts
    (E, out, in)), by its parameter name: the reference slice of this rank. PEFT's A is (r*E, in), B (out, r*E):
    a tensor split along out (dim 1) has B's rows split the same way, one split along in (dim 2) A's columns."""
    from peft.tuners.lora import ParamWrapper

    cuts = {}
    for module_name, module in full_peft.named_modules():
        if not isinstance(module, ParamWrapper):
            continue
        owner = module_name.removeprefix("base_model.model.").replace(".base_layer", "")
        split = splits.get(f"{owner}.{module.parameter_name}")
        for which, container in (("A", module.lora_A), ("B", module.lora_B)):
            for adapter in container:
                cut = None
                if split is not None and split.dim is not None and (which == "B") == (split.dim == 1):
                    def cut(full, ws, rank, split=split):  # (out, rE) as (1, out, rE); (rE, in) as (1, rE, in)
                        return split.local(full.unsqueeze(0), ws, rank).squeeze(0)
                cuts[f"{module_name}.lora_{which}.{adapter}.weight"] = cut
    return cuts


def lora_case(ref: str, verify_index: int, class_name: str, targets: list[str], folder: str,
              dtype=torch.float64, modules_to_save: list[str] | None = None, int8_base: bool = False,
              sequence_parallel: bool = False, target_parameters: list[str] | None = None) -> dict:
    """`int8_base`: the base's Linear layers (not the LM head) quantized by torchao (int8 weight-only) before
    sharding, QLoRA-style: a frozen quantized base under float adapters, on both sides. `sequence_parallel`:
    `target_parameters`: PEFT's LoRA on bare tensors too (MoE experts). `sequence_parallel`:
    applied with it, on SP_SEQ tokens (an encoder-decoder's decoder too), which every world size divides: the
    report's "sp_split" lists, per stack, whether its last forward ran split."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = verify.build_model(ref, verify_index, class_name).to(dtype)
    if int8_base:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(full, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    if dtype == torch.float64 and full._can_set_experts_implementation():
        full.set_experts_implementation("eager")
    loaded = verify.resolve(ref)
    if sequence_parallel:
        inputs = verify.example_inputs(full, loaded.mapping.verify[verify_index].inputs, seq=SP_SEQ, seed=5)
        if "decoder_input_ids" in inputs:  # (seq // 2 + 1 by default)
            inputs["decoder_input_ids"] = torch.randint(3, full.config.vocab_size, (2, SP_SEQ),
                                                        generator=torch.Generator().manual_seed(6))
    else:
        inputs = verify.case_inputs(ref, verify_index, full)
    inputs, has_labels = loss_kwargs(full, in_dtype(inputs, dtype))
    sharded = tpmap.apply(copy.deepcopy(full), ws, mapping=loaded, sequence_parallel=sequence_parallel)
    plan = sharded.tpmap_plan
    splits = slicing_reference.splits(full, loaded, plan, ws)
    reverse = {m.name + ".weight": m.reverse for m in plan.modules}

    def config():
        return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                          modules_to_save=modules_to_save, target_parameters=target_parameters)

    pristine = copy.deepcopy(full)  # (get_peft_model wraps `full` in place)
    torch.manual_seed(1)  # init_lora_weights=False: A and B random, so every term of the math is exercised
    full_peft = unsharded_peft_model(full, config())
    sharded_peft = tpmap.peft.get_peft_model(sharded, config())
    full_named = dict(full_peft.named_parameters())
    experts = _expert_slicer(full_peft, splits)

    def reference(name, full_tensor):  # this rank's slice of a full-size adapter tensor (or its gradient)
        if name in experts:
            return full_tensor.detach() if experts[name] is None else experts[name](full_tensor, ws, rank)
        base, which = _base_name(name)
        return _reference_slice(full_tensor.detach(), which, splits.get(base), reverse.get(base, False), ws, rank)
    report = {"adapters": 0, "split": 0, "fresh_whole_differs": 0, "expert_adapters": len(experts)}
    with torch.no_grad():
        for name, p in sharded_peft.named_parameters():
            if LORA not in name and ".modules_to_save." not in name:
                continue
            # a fresh adapter: whole tensors equal on every rank (whole on every rank: at an uneven world size a
            # split tensor's local shapes differ from rank to rank, and cannot be gathered as they are)
            whole = torch.tensor([int(tuple(p.shape) == tuple(full_named[name].shape))])
            dist.all_reduce(whole, op=dist.ReduceOp.MIN)
            if whole.item():
                gathered = [torch.empty_like(p) for _ in range(ws)]
                dist.all_gather(gathered, p.detach().contiguous())
                report["fresh_whole_differs"] += int(any(not torch.equal(g, p) for g in gathered))
            want = reference(name, full_named[name])
            report["split"] += int(tuple(want.shape) != tuple(full_named[name].shape))
            assert want.shape == p.shape, (name, tuple(want.shape), tuple(p.shape), splits.get(_base_name(name)[0]))
            p.copy_(want)
            report["adapters"] += 1

    encoder_decoder = getattr(full.config, "is_encoder_decoder", False)

    def forward(model):  # (an encoder-decoder keeps its labels: its decoder inputs are made from them)
        out = model(**{k: v for k, v in inputs.items() if k != "labels" or encoder_decoder})
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    logits_full, logits_sharded = forward(full_peft), forward(sharded_peft)
    seq_state = getattr(sharded, "tpmap_sequence", None)
    report["sp_split"] = None if seq_state is None else sorted(seq_state.stack_split.values())
    report["logits_rel"] = ((logits_full - logits_sharded).abs().max() / logits_full.abs().max()).item()
    loss_of(full_peft, inputs, has_labels).backward()
    loss_of(sharded_peft, inputs, has_labels).backward()
    worst, worst_name = 0.0, ""
    for name, p in sharded_peft.named_parameters():
        if not p.requires_grad:
            continue
        want = reference(name, full_named[name].grad)
        got = p.grad if p.grad is not None else torch.zeros_like(p)  # (never used: no gradient)
        rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        if rel > worst:
            worst, worst_name = rel, name
    report["grad_rel"], report["grad_worst"] = worst, worst_name
    report["trainable"] = sum(1 for p in sharded_peft.parameters() if p.requires_grad)
    # two SGD steps on the adapters, then the logits again
    for model in (full_peft, sharded_peft):
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
        opt.step()
        opt.zero_grad()
        loss_of(model, inputs, has_labels).backward()
        opt.step()
    stepped = forward(full_peft)
    report["stepped_rel"] = ((stepped - forward(sharded_peft)).abs().max() / stepped.abs().max()).item()
    report["generate_same"] = None
    if class_name.endswith("ForCausalLM"):  # greedy tokens of the stepped adapters, unpadded prompts
        prompt = inputs["input_ids"][:, :5]
        kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(prompt))
        report["generate_same"] = torch.equal(full_peft.generate(input_ids=prompt, **kw),
                                              sharded_peft.generate(input_ids=prompt, **kw))
    # a second adapter beside the first (add_adapter with a config PEFT did not see registered: the layers are
    # already tpmap's), switched to and back with set_adapter
    second = LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False,
                        target_parameters=target_parameters)
    full_peft.add_adapter("second", second)
    sharded_peft.add_adapter("second", second)
    full_named = dict(full_peft.named_parameters())
    experts = _expert_slicer(full_peft, splits)
    with torch.no_grad():
        for name, p in sharded_peft.named_parameters():
            if ".second." in name or name.endswith(".second"):  # (an embedding LoRA: a bare Parameter)
                want = reference(name, full_named[name])
                assert want.shape == p.shape, (name, tuple(want.shape), tuple(p.shape))
                p.copy_(want)
    for model in (full_peft, sharded_peft):
        model.set_adapter("second")
    want = forward(full_peft)
    report["second_rel"] = ((forward(sharded_peft) - want).abs().max() / want.abs().max()).item()
    for model in (full_peft, sharded_peft):
        model.set_adapter("default")
    # saved from the sharded model: a standard, full-size adapter that plain PEFT loads on the unsharded base
    tpmap.save_pretrained(sharded_peft, folder)  # (delegated to tpmap.peft.save_pretrained)
    want = forward(full_peft)
    if rank == 0:
        from peft import PeftModel
        from safetensors.torch import load_file

        # the file unsharded PEFT writes for the same (stepped) adapter: the same names, shapes and values
        full_peft.save_pretrained(f"{folder}/unsharded", selected_adapters=["default"])
        got, expected = (load_file(f"{f}/adapter_model.safetensors") for f in (folder, f"{folder}/unsharded"))
        # (PEFT adds a targeted LM head's frozen base weight only where the head is an nn.Linear: not tpmap's)
        expected = {k: t for k, t in expected.items() if "lm_head.base_layer." not in k}
        report["file_shapes_ok"] = {k: tuple(t.shape) for k, t in got.items()} == {
            k: tuple(t.shape) for k, t in expected.items()}
        report["file_rel"] = max(((got[k] - t).abs().max() / t.abs().max().clamp_min(1e-30)).item()
                                 for k, t in expected.items()) if report["file_shapes_ok"] else float("inf")
        report["file_diff"] = {k: (tuple(got[k].shape) if k in got else None, tuple(t.shape) if t is not None else None)
                               for k, t in {**dict.fromkeys(got), **expected}.items()
                               if k not in got or k not in expected or got[k].shape != t.shape}  # (for the message)
        plain = PeftModel.from_pretrained(copy.deepcopy(pristine), folder)
        report["saved_rel"] = ((forward(plain) - want).abs().max() / want.abs().max()).item()
    # and loaded onto a fresh sharded model, each rank reading its slices
    reloaded = tpmap.peft.from_pretrained(tpmap.apply(copy.deepcopy(pristine), ws, mapping=loaded,
                                                      sequence_parallel=sequence_parallel), folder)
    report["loaded_rel"] = ((forward(reloaded) - want).abs().max() / want.abs().max()).item()
    if int8_base:  # (merging into a quantized weight re-quantizes it: PEFT needs the quantizer's config for that)
        report["merged_rel"], report["merged_left"] = 0.0, 0
        return report
    # merge into the local weights: the same logits, adapters gone
    merged_full, merged_sharded = full_peft.merge_and_unload(), sharded_peft.merge_and_unload()
    report["merged_rel"] = ((forward(merged_full) - forward(merged_sharded)).abs().max()
                            / forward(merged_full).abs().max()).item()
    report["merged_left"] = sum(1 for n, _ in merged_sharded.named_parameters() if LORA in n)
    return report


def bad_adapter_case(folder: str) -> dict:
    """Adapters that do not fit, loaded onto a sharded Llama: one trained on a model with a wider MLP (another
    size), and one whose file lacks a tensor. Each is refused on every rank alike, and the model is left as it
    was: the same module classes, requires_grad flags, state-dict names and logits, no peft_config."""
    from peft import PeftModel

    ws, rank = dist.get_world_size(), dist.get_rank()
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    if rank == 0:
        config = verify.tiny_config("llama", 0)
        config.intermediate_size *= 2
        other = transformers_class("LlamaForCausalLM")(config)
        torch.manual_seed(2)
        unsharded_peft_model(other, LoraConfig(r=4, target_modules=targets)).save_pretrained(f"{folder}/wider")
        fits = unsharded_peft_model(verify.build_model("llama", 0, "LlamaForCausalLM"),
                                    LoraConfig(r=4, target_modules=targets))
        fits.save_pretrained(f"{folder}/fits")
        fits.save_pretrained(f"{folder}/missing")
        from safetensors.torch import load_file, save_file

        tensors = load_file(f"{folder}/missing/adapter_model.safetensors")
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, f"{folder}/missing/adapter_model.safetensors")
    dist.barrier()
    sharded = tpmap.apply(verify.build_model("llama", 0, "LlamaForCausalLM"), ws)
    ids = torch.arange(12).view(2, 6)

    def state():
        return ([(n, type(m).__name__) for n, m in sharded.named_modules()],
                [(n, p.requires_grad) for n, p in sharded.named_parameters()], list(sharded.state_dict()),
                "peft_config" in vars(sharded))

    before, logits = state(), sharded(input_ids=ids).logits
    report = {}
    for kind in ("wider", "missing"):
        try:
            tpmap.peft.from_pretrained(sharded, f"{folder}/{kind}")
            report[kind] = None
        except ValueError as e:
            report[kind] = str(e)
        report[f"{kind}_untouched"] = state() == before
        report[f"{kind}_same_logits"] = torch.equal(sharded(input_ids=ids).logits, logits)
    # and an adapter that fits still loads afterwards
    loaded = tpmap.peft.from_pretrained(sharded, f"{folder}/fits")
    report["then_loads"] = isinstance(loaded, PeftModel) and any(LORA in n for n, _ in loaded.named_parameters())
    return report


def transformers_class(name: str):
    import transformers

    return getattr(transformers, name)


def _refused(sharded, config) -> dict:
    """tpmap.peft.get_peft_model(sharded, config) expected to raise NotImplementedError: its message (None if it
    did not raise) and whether the model was left as it was (modules, requires_grad, no peft_config)."""
    def state():
        return ([(n, type(m).__name__) for n, m in sharded.named_modules()],
                [(n, p.requires_grad) for n, p in sharded.named_parameters()], "peft_config" in vars(sharded))

    before = state()
    try:
        tpmap.peft.get_peft_model(sharded, config)
        message = None
    except NotImplementedError as e:
        message = str(e)
    return {"message": message, "untouched": state() == before}


def expert_target_case() -> dict:
    """LoRA aimed at MoE expert tensors that a Param entry splits in a layout tpmap.peft does not split adapters
    for (DBRX's experts stacked as 2-D (E * I, H), split along dim 0 in E sections): refused, naming the tensor,
    and the model left as it was."""
    sharded = tpmap.apply(verify.build_model("dbrx", 0, "DbrxForCausalLM"), dist.get_world_size())
    return _refused(sharded, LoraConfig(r=4, target_modules=["out_proj"], target_parameters=["ffn.experts.mlp.w1"]))


def parallel_experts_target_case() -> dict:
    """LoRA aimed at the expert tensors of a model sharded with experts='parallel' (Mixtral: whole experts dealt
    to the ranks): refused, naming the tensor and experts='split', and the model left as it was."""
    sharded = tpmap.apply(verify.build_model("mixtral", 0, "MixtralForCausalLM"), dist.get_world_size(),
                          experts="parallel")
    return _refused(sharded, LoraConfig(r=4, target_modules=["q_proj"],
                                        target_parameters=["mlp.experts.gate_up_proj"]))


def dp_tp_lora_case(wrap: str = "ddp", steps: int = 2) -> dict:
    """LoRA on a (dp=2, tp=2) mesh: tpmap over tp, DDP (or FSDP2: "fsdp") over dp, each dp replica on its half
    of a batch, only the adapters training; against unsharded PEFT stepped on the whole batch (fp64, SGD).
    Returns the worst relative difference of the adapters' updates (this rank's slice of each) and whether
    any base parameter moved."""
    import data_parallel_cases
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = data_parallel_cases.mesh_2x2()
    dp_rank, tp_rank, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(), mesh["tp"].size()
    full = data_parallel_cases.build("llama", "LlamaForCausalLM", {}, torch.float64)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    sharded = tpmap.apply(copy.deepcopy(full), group=mesh["tp"])
    plan = sharded.tpmap_plan
    splits = slicing_reference.splits(full, tpmap.read_mapping(full), plan, tp)
    reverse = {m.name + ".weight": m.reverse for m in plan.modules}

    def config():
        return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)

    torch.manual_seed(1)
    full_peft = unsharded_peft_model(full, config())
    sharded_peft = tpmap.peft.get_peft_model(sharded, config())
    full_named = dict(full_peft.named_parameters())
    with torch.no_grad():
        for name, p in sharded_peft.named_parameters():
            if LORA in name:
                base, which = _base_name(name)
                p.copy_(_reference_slice(full_named[name].detach(), which, splits.get(base), reverse.get(base, False),
                                         tp, tp_rank))
    before = {n: p.detach().clone() for n, p in sharded_peft.named_parameters()}
    full_before = {n: p.detach().clone() for n, p in full_peft.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(3, full.config.vocab_size, (4, 12), generator=gen)
    half = batch[2 * dp_rank: 2 * dp_rank + 2]  # (2, 12): this dp replica's share
    if wrap == "ddp":
        wrapped = DDP(sharded_peft, process_group=mesh["dp"].get_group())
    else:
        from torch.distributed.fsdp import fully_shard
        wrapped = fully_shard(sharded_peft, mesh=mesh["dp"])

    def loss_of(model, ids):  # fp64 all through
        logits = model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    opt = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
    opt_full = torch.optim.SGD([p for p in full_peft.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        for model, optimizer, ids in ((wrapped, opt, half), (full_peft, opt_full, batch)):
            optimizer.zero_grad()
            loss_of(model, ids).backward()  # mean over this half; DDP/FSDP average the halves' grads
            optimizer.step()
    worst, worst_name, base_moved, adapters = 0.0, "", False, 0
    for name, p in sharded_peft.named_parameters():
        local = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: the dp shards gathered back
        if LORA not in name:
            base_moved |= not torch.equal(local.detach(), before[name])
            continue
        base, which = _base_name(name)
        want_step = _reference_slice(full_named[name].detach() - full_before[name], which, splits.get(base),
                                     reverse.get(base, False), tp, tp_rank)
        got_step = local.detach() - before[name]
        rel = ((got_step - want_step).abs().max() / want_step.abs().max().clamp_min(1e-30)).item()
        adapters += 1
        if rel > worst:
            worst, worst_name = rel, name
    return {"worst_rel": worst, "worst_name": worst_name, "base_moved": base_moved, "adapters": adapters,
            "dp": dp_rank, "tp": tp_rank}


def lora_dropout_case(sequence_parallel: bool = False) -> dict:
    """LoRA dropout in training mode follows the RNG regions: the masks on a Column's replicated input (q, k, v:
    k and v run after q has opened the sharded region) are the same on every rank, the masks on a Row's split
    input (o_proj) differ, and the replicated output is the same on every rank. With sequence parallelism the
    Columns' input is the gathered sequence, replicated (the block's region is open: their masks come from the
    default stream all the same), and the Row's is this rank's features of every token."""
    ws = dist.get_world_size()
    sharded = tpmap.apply(verify.build_model("llama", 0, "LlamaForCausalLM"), ws, sequence_parallel=sequence_parallel)
    model = tpmap.peft.get_peft_model(sharded, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                          lora_dropout=0.5, init_lora_weights=False))
    masks = {}
    for name, module in model.named_modules():
        if name.endswith("lora_dropout.default") and ".layers.0." in name:
            module.register_forward_hook(lambda m, args, out, name=name: masks.__setitem__(
                name.split(".")[-3], (out == 0) & (args[0] != 0)))
    torch.manual_seed(3)  # the same on every rank, as a training script seeds
    logits = model.train()(input_ids=torch.arange(16).view(2, 8) % 200).logits
    report = {}
    for key, value in {**masks, "logits": logits.detach()}.items():
        everyone = [torch.empty_like(value) for _ in range(ws)]
        dist.all_gather(everyone, value.contiguous())
        report[key] = all(torch.equal(everyone[0], v) for v in everyone[1:])
    return report


def expert_adapter_trainable_later_case(folder: str) -> dict:
    """An expert adapter (target_parameters) loaded for inference onto a sharded Mixtral, then made trainable: the
    whole factors' gradients (A of gate_up_proj, B of down_proj) still get their all-reduce, attached at the first
    forward that trains. Returns the worst relative difference of each whole factor's gradient against unsharded
    PEFT's on the same adapter and loss (fp64)."""
    from peft import PeftModel

    ws = dist.get_world_size()
    full = verify.build_model("mixtral", 0, "MixtralForCausalLM").to(torch.float64)
    full.set_experts_implementation("eager")
    if dist.get_rank() == 0:
        torch.manual_seed(4)
        config = LoraConfig(r=4, target_modules=[], target_parameters=["mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"],
                            init_lora_weights=False)
        unsharded_peft_model(copy.deepcopy(full), config).save_pretrained(folder)
    dist.barrier()
    loaded = tpmap.peft.from_pretrained(tpmap.apply(copy.deepcopy(full), ws), folder)  # inference
    plain = PeftModel.from_pretrained(full, folder, is_trainable=True)
    for name, p in loaded.named_parameters():
        p.requires_grad_(LORA in name)
    ids = torch.arange(2, 26).view(2, 12) % 200
    for model in (loaded, plain):
        model(input_ids=ids, labels=ids).loss.backward()
    want = dict(plain.named_parameters())
    worst = {}
    for name, p in loaded.named_parameters():
        if LORA in name and p.shape == want[name].shape:  # a whole factor
            g = want[name].grad
            worst[name] = ((p.grad - g).abs().max() / g.abs().max()).item()
    return worst
