"""Functions the checkpoint tests run on every rank of a RankPool (importable by name in the rank
processes). Each computes its reference in the same run and returns plain data."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist
import transformers

import tpmap
from tpmap import verify


class _CountReads:
    """Counts the tensor bytes tpmap reads from checkpoint files while active."""

    def __enter__(self):
        from tpmap.checkpoint.safetensors import SafetensorsFile

        self.bytes, self.original = 0, SafetensorsFile.read_into

        def counting(file, buffer, offset):
            self.bytes += len(buffer)
            return self.original(file, buffer, offset)

        SafetensorsFile.read_into = counting
        return self

    def __exit__(self, *exc):
        from tpmap.checkpoint.safetensors import SafetensorsFile

        SafetensorsFile.read_into = self.original


def _differences(want: dict, got: dict) -> list[str]:
    """Names whose tensors differ in name, dtype, shape or any bit."""
    out = sorted(want.keys() ^ got.keys())
    for name in sorted(want.keys() & got.keys()):
        a, b = want[name], got[name]
        a_bytes = a.reshape(-1).view(torch.uint8) if a.numel() else a
        b_bytes = b.reshape(-1).view(torch.uint8) if b.numel() else b
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device or not torch.equal(a_bytes, b_bytes):
            out.append(name)
    return out


def _tensors(model: torch.nn.Module) -> dict:
    """Every parameter and buffer (non-persistent ones too), by name."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def from_pretrained_equals_apply(folder: str, class_names: list[str], dtype: str | None = None,
                                 gap_bytes: int | None = None, block_rows: int | None = None,
                                 logits_of: tuple[str, int] | None = None, **hf_kwargs) -> dict:
    """For each class: tpmap.from_pretrained against tpmap.apply on the model transformers loads, bit for bit
    (parameters, buffers, ties, generation config, loading info), and against the independent reference's
    slices of that unsharded model (tests/slicing_reference.py: neither the plan's pieces nor `take`); the
    bytes each rank read, and the blocks of rows read (``block_tensors`` tensors in ``blocks`` blocks).
    `gap_bytes`: engine.slice_io.GAP_BYTES for this call (0: every run read on its own, no gaps read);
    `block_rows`: engine.slice_io.BLOCK_ROWS (blocks of that many rows, so small tensors span many blocks).
    `logits_of`: (mapping, verify index) whose example inputs both models also run (``max_diff`` of the sharded
    main output from the unsharded one, and its ``scale``)."""
    from tpmap.engine import slice_io

    ws = dist.get_world_size() if dist.is_initialized() else 1
    torch_dtype = getattr(torch, dtype) if dtype else None
    saved = slice_io.GAP_BYTES, slice_io.BLOCK_ROWS, slice_io._read_in_blocks
    counts = {"block_tensors": 0, "blocks": 0}

    def counting(read_into, *args):
        counts["block_tensors"] += 1

        def read(buffer, offset):
            counts["blocks"] += 1
            read_into(buffer, offset)

        return saved[2](read, *args)

    slice_io.GAP_BYTES = saved[0] if gap_bytes is None else gap_bytes
    slice_io.BLOCK_ROWS, slice_io._read_in_blocks = block_rows, counting
    try:
        out = {}
        for name in class_names:
            counts.update(block_tensors=0, blocks=0)
            out[name] = {**_equals_apply(folder, name, torch_dtype, ws, hf_kwargs, logits_of), **counts}
        return out
    finally:
        slice_io.GAP_BYTES, slice_io.BLOCK_ROWS, slice_io._read_in_blocks = saved


def _reference(full: torch.nn.Module, ws: int) -> dict:
    """Every parameter and buffer of `full` (unsharded) as this rank should hold it: the independent
    reference's slice of each tensor the mapping splits, every other tensor as it is."""
    import slicing_reference

    tensors = _tensors(full)
    if ws == 1:
        return {k: v.detach().clone() for k, v in tensors.items()}
    loaded = tpmap.read_mapping(full)
    splits = slicing_reference.splits(full, loaded, tpmap.plan(full, ws, mapping=loaded), ws)
    rank = dist.get_rank()
    return {k: splits[k].local(v, ws, rank) if k in splits else v.detach().clone() for k, v in tensors.items()}


def _equals_apply(folder: str, name: str, torch_dtype, ws: int, hf_kwargs: dict,
                  logits_of: tuple[str, int] | None = None) -> dict:
    """One class: both loads, compared; the reference slices of the unsharded load; the bytes tpmap read and
    the bytes the rank keeps; the main outputs on `logits_of`'s example inputs, where given."""
    cls = getattr(transformers, name)
    torch.manual_seed(0)  # missing weights are drawn from the same stream in both
    full, info_hf = cls.from_pretrained(folder, dtype=torch_dtype, output_loading_info=True, **hf_kwargs)
    reference = _reference(full, ws)
    # on a copy: a forward may add state (caches) that apply would then carry
    logits = _unsharded_output(copy.deepcopy(full), *logits_of) if logits_of is not None else {}
    want = tpmap.apply(full, ws)
    torch.manual_seed(0)
    with _CountReads() as reads:
        got, info = tpmap.from_pretrained(folder, model_class=name, dtype=torch_dtype, output_loading_info=True,
                                          **hf_kwargs)
    mine = _tensors(got)
    ties = lambda m: sorted(sorted(ns) for ns in _tie_groups(m) if len(ns) > 1)  # noqa: E731
    return {
        "differ": _differences(_tensors(want), mine),
        # against the reference: every tensor both hold (the sharded model adds index buffers, and drops
        # the ModuleList items of other ranks)
        "differ_reference": _differences({k: v for k, v in reference.items() if k in mine},
                                         {k: v for k, v in mine.items() if k in reference}),
        "compared_reference": len(reference.keys() & mine.keys()),
        "ties_equal": ties(want) == ties(got),
        "info_equal": {k: sorted(map(str, v)) for k, v in info.items()} == {
            k: sorted(map(str, v)) for k, v in info_hf.items()},
        "info": {k: sorted(map(str, v)) for k, v in info.items()},
        "generation_equal": (want.generation_config.to_dict() == got.generation_config.to_dict()
                             if want.can_generate() else True),
        "training": got.training,
        "read": reads.bytes,
        "kept": sum(t.numel() * t.element_size() for t, _ in _unique(got)),
        **_logits(got, logits),
    }


def _unsharded_output(full: torch.nn.Module, ref: str, verify_index: int) -> dict:
    """The example inputs of a verify config and the unsharded model's main output on them."""
    inputs = verify.case_inputs(ref, verify_index, full)
    with torch.no_grad():
        return {"inputs": inputs, "want": verify.main_output(full(**inputs))}


def _logits(got: torch.nn.Module, logits: dict) -> dict:
    """A loaded sharded model's main output against the unsharded one (`logits` from _unsharded_output)."""
    if not logits:
        return {}
    with torch.no_grad():
        out = verify.main_output(got(**logits["inputs"]))
    return {"max_diff": (out - logits["want"]).abs().max().item(), "scale": logits["want"].abs().max().item()}


def _unique(model):
    seen = {}
    for name, t in _tensors(model).items():
        seen.setdefault(id(t), (t, name))
    return list(seen.values())


def _tie_groups(model) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(t), []).append(name)
    return list(groups.values())


def save_sharded(ref: str, verify_index: int, class_name: str, folder: str, **hf_kwargs) -> None:
    """apply -> tpmap.save_pretrained (the test compares the files with transformers' save of the same model)."""
    model = tpmap.apply(verify.build_model(ref, verify_index, class_name), dist.get_world_size(),
                        mapping=verify.resolve(ref))
    tpmap.save_pretrained(model, folder, **hf_kwargs)


def logits_from_pretrained(ref: str, verify_index: int, class_name: str, folder: str) -> dict:
    """tpmap.from_pretrained at this world size against plain transformers loading the same folder, unsharded
    (the model it was saved from, except what transformers recomputes on load: Marian's sinusoidal positions)."""
    import transformers

    logits = _unsharded_output(getattr(transformers, class_name).from_pretrained(folder), ref, verify_index)
    return _logits(tpmap.from_pretrained(folder, model_class=class_name, mapping=verify.resolve(ref)), logits)


def load_error(folder: str, **kwargs) -> dict:
    """from_pretrained that must fail: the error on this rank; then a barrier shows no rank is left hanging."""
    try:
        tpmap.from_pretrained(folder, **kwargs)
        error = None
    except Exception as e:  # the test inspects the type and message
        error = (type(e).__name__, str(e))
    dist.barrier()
    return {"error": error}


def whole_conversions(folder: str, class_name: str) -> dict:
    """The fallback: every converted tensor read whole and sliced; the same bits, with a warning."""
    from tpmap.checkpoint import conversion

    ws = dist.get_world_size()
    want = tpmap.apply(getattr(transformers, class_name).from_pretrained(folder), ws)
    conversion.LAZY_CONVERSIONS = False
    try:
        with warnings.catch_warnings(record=True) as caught, _CountReads() as reads:
            warnings.simplefilter("always")
            got = tpmap.from_pretrained(folder, model_class=class_name)
    finally:
        conversion.LAZY_CONVERSIONS = True
    return {"differ": _differences(_tensors(want), _tensors(got)), "read": reads.bytes,
            "warnings": [str(w.message) for w in caught if "tpmap" in str(w.message)]}


def fails_on_one_rank(folder: str) -> dict:
    """Rank 1 fails while reading (after every check passed): every rank must raise, none hang."""
    from tpmap.checkpoint.safetensors import SafetensorsFile

    original = SafetensorsFile.read_into

    def broken(file, buffer, offset):
        raise OSError(f"simulated read error in {file.path.name}")

    if dist.get_rank() == 1:
        SafetensorsFile.read_into = broken
    try:
        tpmap.from_pretrained(folder)
        error = None
    except Exception as e:  # the test inspects the type and message
        error = (type(e).__name__, str(e))
    finally:
        SafetensorsFile.read_into = original
    dist.barrier()
    return {"error": error}


def fused_qkv(folder: str, lazy: bool) -> dict:
    """A checkpoint whose q, k, v are one stored tensor, split by a (registered) transformers Chunk
    conversion: one stored tensor makes three targets. Lazily each rank reads only its rows of each
    (a selection of stored rows, no gap read); with lazy conversions off it converts the whole tensor
    (the fallback), with a warning. Both equal apply on transformers' load."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    from tpmap.checkpoint import conversion
    from tpmap.engine import slice_io

    conversion_mapping.register_checkpoint_conversion_mapping("LlamaForCausalLM", [WeightConverter(
        "self_attn.qkv_proj.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        operations=[Chunk(dim=0)])], overwrite=True)
    saved = slice_io.GAP_BYTES
    conversion.LAZY_CONVERSIONS, slice_io.GAP_BYTES = lazy, 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _equals_apply(folder, "LlamaForCausalLM", None, dist.get_world_size(), {})
    finally:
        conversion.LAZY_CONVERSIONS, slice_io.GAP_BYTES = True, saved
        conversion_mapping._checkpoint_conversion_mapping_cache.pop("LlamaForCausalLM")
        conversion_mapping.USER_REGISTERED_MAPPINGS.discard("LlamaForCausalLM")
    result["warnings"] = [str(w.message) for w in caught if "tpmap" in str(w.message)]
    return result


def load_and_save(folder: str, out: str, class_name: str) -> dict:
    """tpmap.from_pretrained, then tpmap.save_pretrained: what loading renamed is saved under the old names."""
    model = tpmap.from_pretrained(folder, model_class=class_name)
    tpmap.save_pretrained(model, out)
    return {}


def loss_parallel_loss(folder: str) -> dict:
    """from_pretrained(loss_parallel=True) against apply(loss_parallel=True) on transformers' load: the
    same vocabulary-parallel loss, bit for bit, in training mode (logits kept split)."""
    ws = dist.get_world_size()
    want = tpmap.apply(transformers.LlamaForCausalLM.from_pretrained(folder), ws, loss_parallel=True).train()
    got = tpmap.from_pretrained(folder, loss_parallel=True).train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, want.config.vocab_size, (2, 9), generator=gen)
    ids = verify.place_ids(ids, verify.boundary_ids(want, (ws,)), gen)  # labels on the shard boundaries too
    out_want, out_got = want(input_ids=ids, labels=ids), got(input_ids=ids, labels=ids)
    return {"same_loss": torch.equal(out_want.loss, out_got.loss), "local_vocab": out_got.logits.shape[-1],
            "vocab": want.config.vocab_size}
