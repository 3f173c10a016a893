"""`tpmap.from_pretrained`: a tensor-parallel model straight from a checkpoint folder, every rank reading
only its own slices.

The steps mirror transformers' `from_pretrained` and reuse its parts (config, dtype, the model built on
the meta device under its init context, the conversion mapping, tying, initializing missing weights,
the loading report, the generation config); only the reading differs:

1. open the folder (`tpmap.checkpoint.safetensors`): every file's header is checked, nothing read yet;
2. refuse quantized checkpoints other than FP8 block-scaled and compressed-tensors ones, whose weights are paired
   with their scales and dequantized as they are read (`tpmap.checkpoint.fp8`, `tpmap.checkpoint.compressed`);
   build the model on the meta device, match checkpoint names to model tensors (`tpmap.checkpoint.conversion`)
   and check every shape; tie weights; build the plan (`tpmap.prepare.prepare`: every mapping check, the
   options); up to here every bad input raises on every rank alike, before any collective;
3. materialize and initialize what the checkpoint lacks (missing weights, non-persistent buffers such
   as rotary ``inv_freq``) on the full-size model exactly as transformers does, so random init and
   computed buffers equal those of a fully loaded model;
4. read the tensors that stay whole, then execute the plan (`tpmap.execute.apply_plan`) with a reader that
   reads each split tensor's slice for this rank from the file instead of slicing a loaded tensor;
5. with ``quantization_config=TorchAoConfig(...)``: quantize each rank's slices with the scales the whole weights
   would get (`tpmap.checkpoint.quantize`; which weights, and a group a boundary would cut, decided in step 2);
6. agree: one all-reduce of a failure flag, so a rank that failed while reading makes every rank raise.

The result equals ``tpmap.apply(AutoModel...from_pretrained(path), world_size)`` bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tpmap.checkpoint import compressed, conversion, quantize
from tpmap.checkpoint.errors import CheckpointError, OtherRankError
from tpmap.checkpoint.fp8 import Fp8Scales, block_size
from tpmap.checkpoint.safetensors import Checkpoint
from tpmap.engine import planner
from tpmap.engine.errors import UnsupportedConfigError
from tpmap.engine.plan import Plan
from tpmap.engine.shard import take
from tpmap.execute import apply_plan
from tpmap.language.errors import TpmapError
from tpmap.language.source import MappingFile
from tpmap.prepare import Place, Prepared, prepare, read_mapping

# transformers' from_pretrained arguments that place, quantize or supply weights some other way
_NOT_HERE = {
    "device_map": "pass device=... (this rank's device)", "max_memory": "tpmap places each rank's slices itself",
    "offload_folder": "tpmap does not offload", "offload_buffers": "tpmap does not offload",
    "tp_plan": "tpmap's mapping is the plan", "tp_size": "pass world_size=...", "distributed_config": "pass group=...",
    "device_mesh": "pass group=...",
    "gguf_file": "tpmap reads safetensors", "state_dict": "load the state dict with apply() instead",
    "use_safetensors": "tpmap reads safetensors only", "ignore_mismatched_sizes": "mismatched shapes are errors",
    "adapter_kwargs": "adapters are not supported", "adapter_name": "adapters are not supported",
    "use_kernels": "hub kernels are not supported", "kernel_config": "hub kernels are not supported",
    "cache_dir": "tpmap reads a local folder", "revision": "tpmap reads a local folder",
    "force_download": "tpmap reads a local folder", "token": "tpmap reads a local folder",
}


def from_pretrained(path, *, world_size: int | None = None, group=None, model_class=None, dtype=None, device=None,
                    mapping=None, loss_parallel: bool = False, check_inputs: bool = True,
                    sequence_parallel: bool = False, quantization_config=None, experts: str | None = None,
                    **hf_kwargs):
    """Load a tensor-parallel model from a local transformers checkpoint folder, on every rank.

    Each rank reads only its slices of the safetensors files (single-file or sharded with
    ``model.safetensors.index.json``), casts them to `dtype` and puts them on `device`; the result equals
    ``tpmap.apply(<class>.from_pretrained(path), world_size)``, parameter for parameter.

    * ``model_class``: a transformers model class, its name, or an Auto class (default: the first of
      ``config.architectures``).
    * ``dtype``: as transformers' (default ``"auto"``: the config's dtype).
    * ``device``: where this rank's tensors go, e.g. ``f"cuda:{local_rank}"`` (default: CPU).
    * ``mapping``, ``world_size``, ``group``, ``loss_parallel``, ``check_inputs``, ``sequence_parallel``,
      ``experts``: as `tpmap.apply`.
    * ``quantization_config``: a ``transformers.TorchAoConfig``: each rank quantizes its slices after reading
      them, with the scales the whole weight would get (`tpmap.checkpoint.quantize`); the result equals
      transformers' own load with the same config, sliced. (A checkpoint that is stored quantized says so in its
      config.json: FP8 block-scaled and compressed-tensors weights are dequantized, any other method is refused.)
    * ``hf_kwargs``: what transformers' `from_pretrained` takes for a local folder: config overrides,
      ``attn_implementation``, ``experts_implementation``, ``key_mapping``, ``variant``, ``subfolder``,
      ``generation_config``, ``trust_remote_code``, ``output_loading_info`` (then returns
      ``(model, info)``, info as transformers': missing, unexpected, mismatched keys, error messages).

    Example (under ``torchrun --nproc-per-node 4``)::

        dist.init_process_group("nccl")
        model = tpmap.from_pretrained("path/to/Llama-3-8B", dtype=torch.bfloat16,
                                      device=f"cuda:{int(os.environ['LOCAL_RANK'])}")
    """
    place = Place.of(world_size, group)
    torchao_config = quantize.torchao_config(quantization_config)
    request = _Request.of(path, dtype, hf_kwargs)
    device = torch.device(device) if device is not None else torch.device("cpu")
    opened = _open(request, model_class, mapping, place, device, experts)
    prepared = prepare(opened.model, opened.loaded, place, loss_parallel=loss_parallel,
                       sequence_parallel=sequence_parallel, check_inputs=check_inputs)
    on_load = _quantization(opened, prepared.plan, torchao_config, request.folder)
    missing = _missing(opened.model, opened.sources)
    failure = _read(opened, prepared, on_load, missing, device)
    _agree(failure, place.tp_size, place.group, device)
    return _finish(opened, request, missing, place.tp_rank)


@dataclass(frozen=True, kw_only=True)
class _Opened:
    """A checkpoint folder opened against its meta model (step 2 up to the plan): the names matched, the weights
    tied, the reader that steps 3-5 read through."""
    checkpoint: Checkpoint
    model: nn.Module  # on the meta device, tied as transformers ties it after loading
    loaded: MappingFile
    dequantizer: Fp8Scales | compressed.CompressedWeights | None  # None: a checkpoint stored unquantized
    conversions: list  # transformers' weight conversions for the model
    sources: dict  # model tensor name -> where the checkpoint holds it
    unexpected: set[str]  # checkpoint names no model tensor takes
    reader: conversion.Reader
    progress: object  # the tqdm bar


def _open(request: _Request, model_class, mapping, place: Place, device: torch.device,
          experts: str | None = None) -> _Opened:
    """Steps 1-2 up to the plan: the folder opened, the meta model built, its mapping read, checkpoint names
    matched to model tensors (every shape checked) and weights tied; every error alike on every rank."""
    import transformers.modeling_utils as hf_modeling
    from transformers.conversion_mapping import get_model_conversion_mapping

    checkpoint = Checkpoint.open(request.folder, request.variant)
    model, dtype = _meta_model(request, checkpoint, model_class)
    dequantizer = _dequantizer(checkpoint, request.folder, model.config)
    loaded = read_mapping(model, mapping, experts)  # before any reading: a model type without a mapping stops here
    conversions = get_model_conversion_mapping(model, request.key_mapping, None)
    sources, unexpected = conversion.match_checkpoint_names(model, checkpoint, conversions)
    if isinstance(dequantizer, compressed.CompressedWeights):
        dequantizer.in_model_dtype = {s.stored[0][1].name for s in sources.values() if s.converter is None}
    dtype_of = _dtypes(model, dtype)
    progress = _progress(place.tp_rank,
                         "Loading tensor-parallel weights" if place.tp_size > 1 else "Loading weights")
    reader = conversion.Reader(model, sources, dtype_of, device, progress, dequantizer)
    _tie(model, reader, hf_modeling.logger)
    return _Opened(checkpoint=checkpoint, model=model, loaded=loaded, dequantizer=dequantizer,
                   conversions=conversions, sources=sources, unexpected=unexpected, reader=reader, progress=progress)


def _dequantizer(checkpoint: Checkpoint, folder: Path, config):
    """What dequantizes the stored weights as they are read: FP8 block scales, compressed-tensors' weights paired
    and checked, or None for a checkpoint stored unquantized; every other quantization is refused here."""
    block = block_size(folder, config)  # None: not quantized; every quantization but FP8 blocks is refused
    dequantizer = Fp8Scales.take(checkpoint, block) if block is not None else None
    if compressed.is_compressed(config):  # compressed-tensors: paired and checked like FP8's scales
        dequantizer = compressed.CompressedWeights.take(checkpoint, folder, config)
    return dequantizer


def _quantization(opened: _Opened, plan: Plan, torchao_config, folder: Path):
    """The last checks of step 2: a compressed-tensors group a shard boundary would cut, and quantization_config=
    on a checkpoint stored quantized, are refused. Returns step 5's quantization (None: not asked). A checkpoint
    stored quantized is dequantized as it is read, so an uneven plan reads it like an even one (FP8 blocks may be
    cut anywhere; a compressed-tensors group a boundary cuts is refused either way); quantization_config= makes
    torchao tensors, which are not proven on uneven splits."""
    model, loaded, dequantizer = opened.model, opened.loaded, opened.dequantizer
    if torchao_config is not None:
        plan.refuse_uneven("quantization_config=")

    def plan_at(tp_size: int):
        return _plan_or_none(model, loaded, tp_size)

    if isinstance(dequantizer, compressed.CompressedWeights):
        compressed.refuse_cut_groups(dequantizer, opened.sources, plan, plan_at)
    if torchao_config is None:
        return None
    if dequantizer is not None:
        raise UnsupportedConfigError(f"{folder} is stored quantized; quantization_config= quantizes "
                                     "an unquantized checkpoint on load: drop one of the two")
    return quantize.OnLoadQuantization(torchao_config, model, plan, plan_at)


def _read(opened: _Opened, prepared: Prepared, on_load, missing: set[str], device: torch.device):
    """Steps 3-5 on this rank: initialize what the checkpoint lacks, read the whole tensors, execute the plan
    with a reader of this rank's slices, quantize. Returns the exception this rank failed with (None: none), for
    every rank to learn of it (`_agree`) before raising."""
    model, plan, place = opened.model, prepared.plan, prepared.place
    try:
        _initialize_missing(model, missing, device)
        opened.progress.total = _load_whole(model, plan if place.tp_size > 1 else None, place.tp_rank,
                                            opened.reader, opened.sources)
        if place.tp_size > 1:
            apply_plan(model, prepared, read=_slice_reader(opened))
        _check_materialized(model)
        if on_load is not None:
            on_load.apply(model, place.group)
    except Exception as e:  # every rank must learn of it (_agree) before raising, or the others would hang later
        return e
    finally:
        opened.progress.close()
        opened.checkpoint.close()
    return None


def _slice_reader(opened: _Opened):
    """`engine.shard.execute`'s `read`: a split tensor's slice for a rank, read from the checkpoint."""
    sources, reader = opened.sources, opened.reader

    def read(full: torch.Tensor, shard, rank: int) -> torch.Tensor:
        if full.device.type != "meta":  # initialized here (missing from the checkpoint) or a computed buffer
            return take(full, shard, rank)
        name = next((n for n in (shard.name, *shard.aliases) if n in sources), None)
        assert name is not None, f"{shard.name} is on meta but neither in the checkpoint nor initialized"
        return reader.local(name, shard, rank)

    return read


def _finish(opened: _Opened, request: _Request, missing: set[str], tp_rank: int):
    """What transformers does after loading: the conversions save_pretrained reverts, the loading report
    (logged on rank 0), eval mode, the generation config. Returns the model, or (model, info)."""
    import transformers.modeling_utils as hf_modeling
    from transformers.utils.loading_report import (
        LoadStateDictInfo,
        log_state_dict_report,
    )

    model, folder = opened.model, request.folder
    model._weight_conversions = [c for c in opened.conversions if c.was_used()]  # save_pretrained reverts these
    if opened.dequantizer is not None and hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # dequantized, as transformers leaves it: saved, a plain checkpoint
    info = LoadStateDictInfo(missing_keys=missing, unexpected_keys=opened.unexpected, mismatched_keys=set(),
                             conversion_errors={}, error_msgs=[], skipped_pp_keys=set())
    model._adjust_missing_and_unexpected_keys(info)
    if tp_rank == 0:
        log_state_dict_report(model=model, pretrained_model_name_or_path=str(folder), ignore_mismatched_sizes=False,
                              loading_info=info, logger=hf_modeling.logger)
    model.eval()
    if model.can_generate() and hasattr(model, "adjust_generation_fn"):
        model.adjust_generation_fn(request.generation_config, False, None, str(folder), cache_dir=None,
                                   force_download=False, proxies=None, local_files_only=True, token=None,
                                   revision=None, subfolder="", trust_remote_code=request.trust_remote_code,
                                   **request.config_kwargs)
    return (model, info.to_dict()) if request.output_loading_info else model


def _plan_or_none(model, loaded, tp_size: int):
    """The plan at tp_size for a quantized checkpoint's "world sizes that work": None where the mapping cannot
    serve tp_size, or would split unevenly (quantized checkpoints refuse uneven plans: `_quantization`)."""
    try:
        plan = planner.build_plan(model, loaded, tp_size)
    except TpmapError:  # (heads that the world size does not divide, ...)
        return None
    return None if plan.uneven else plan


def plan_checkpoint(path, world_size: int, *, model_class=None, dtype=None, mapping=None, experts: str | None = None,
                    **hf_kwargs):
    """The plan `from_pretrained` would execute at `world_size`, from the folder's config alone: the model is
    built on the meta device, no weight is read and no process group is needed. Raises the planner's error
    (a world size the mapping cannot serve, a model type without a mapping, a compressed-tensors group that a
    shard boundary would cut) where a caller can still stop before starting any rank (`tpmap.parallelize` does, in
    its driver). (A compressed-tensors folder's tiny ``weight_shape`` tensors are read.)"""
    from transformers.conversion_mapping import get_model_conversion_mapping

    request = _Request.of(path, dtype, hf_kwargs)
    checkpoint = Checkpoint.open(request.folder, request.variant)
    try:
        model, _ = _meta_model(request, checkpoint, model_class)
        block_size(request.folder, model.config)  # a quantization tpmap does not read is refused here too
        weights = (compressed.CompressedWeights.take(checkpoint, request.folder, model.config)
                   if compressed.is_compressed(model.config) else None)
        loaded = read_mapping(model, mapping, experts)
        plan = prepare(model, loaded, Place.planning(world_size)).plan
        if weights is not None:
            conversions = get_model_conversion_mapping(model, request.key_mapping, None)
            sources, _ = conversion.match_checkpoint_names(model, checkpoint, conversions)
            compressed.refuse_cut_groups(weights, sources, plan,
                                         lambda tp_size: _plan_or_none(model, loaded, tp_size))
    finally:
        checkpoint.close()
    return plan


@dataclass(frozen=True, kw_only=True)
class _Request:
    """transformers' `from_pretrained` arguments, sorted: what tpmap refuses is refused, what it ignores is
    dropped, the named ones are taken out and the rest (`config_kwargs`) are config overrides."""
    folder: Path
    dtype: object
    variant: str | None
    key_mapping: dict | None
    generation_config: object
    trust_remote_code: bool | None
    output_loading_info: bool
    implementations: dict
    config_kwargs: dict

    @classmethod
    def of(cls, path, dtype, hf_kwargs: dict) -> _Request:
        kwargs = dict(hf_kwargs)
        refused = sorted(k for k in kwargs if k in _NOT_HERE)
        if refused:
            raise TypeError("tpmap.from_pretrained does not take " +
                            "; ".join(f"{k} ({_NOT_HERE[k]})" for k in refused))
        if "torch_dtype" in kwargs:  # transformers' older name
            dtype = kwargs.pop("torch_dtype") if dtype is None else dtype
        for name in ("mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict"):
            kwargs.pop(name, None)  # transformers ignores these too
        return cls(dtype=dtype, output_loading_info=kwargs.pop("output_loading_info", False),
                   key_mapping=kwargs.pop("key_mapping", None), variant=kwargs.pop("variant", None),
                   generation_config=kwargs.pop("generation_config", None),
                   trust_remote_code=kwargs.pop("trust_remote_code", None),
                   implementations={k: kwargs.pop(k) for k in ("attn_implementation", "experts_implementation")
                                    if k in kwargs},
                   folder=Path(path) / kwargs.pop("subfolder", ""), config_kwargs=kwargs)


def _meta_model(request: _Request, checkpoint: Checkpoint, model_class):
    """(the model on the meta device as transformers builds it before loading, its dtype)."""
    import transformers.modeling_utils as hf_modeling
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils import ContextManagers

    config, cls, model_kwargs = _config_and_class(request.folder, model_class, request.config_kwargs,
                                                  request.trust_remote_code)
    for key, value in request.implementations.items():
        setattr(config, f"_{key}", value)
    config, dtype = hf_modeling._get_dtype("auto" if request.dtype is None else request.dtype, checkpoint.paths,
                                           config, checkpoint.metadata, None, True, None)
    with ContextManagers(cls.get_init_context(dtype, False, False, False)):
        model = cls(config, **model_kwargs)
        patch_output_recorders(model)
    return model, dtype


def _config_and_class(folder: Path, model_class, kwargs: dict, trust_remote_code):
    """(config, model class, the kwargs the config did not take: for the model's constructor)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.auto_factory import (
        _BaseAutoModelClass,
        _get_model_class,
    )

    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json; tpmap.from_pretrained needs the model folder as "
                              "save_pretrained writes it (config.json and safetensors files)")
    config, rest = AutoConfig.from_pretrained(folder, return_unused_kwargs=True, trust_remote_code=trust_remote_code,
                                              **kwargs)
    if isinstance(model_class, str):
        name = model_class
        model_class = getattr(transformers, name, None)
        if model_class is None:
            raise CheckpointError(f"model_class={name!r} is not a transformers class")
    if model_class is None:
        names = list(getattr(config, "architectures", None) or [])
        model_class = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
        if model_class is None:
            raise CheckpointError(f"{folder}/config.json names no transformers model class (architectures: {names}); "
                                  "pass model_class=, e.g. transformers.AutoModelForCausalLM")
    if isinstance(model_class, type) and issubclass(model_class, _BaseAutoModelClass):
        model_class = _get_model_class(config, model_class._model_mapping)
    return config, model_class, rest


def _dtypes(model: nn.Module, dtype: torch.dtype):
    """name -> the dtype transformers loads it in: the model's (built in `dtype`), or a keep-in-fp32 rule's."""
    from transformers.core_model_loading import build_glob_alternation

    built = {k: v.dtype for k, v in model.state_dict().items()}
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return built.__getitem__
    pattern, groups, _ = build_glob_alternation(list(plan))

    def dtype_of(name: str) -> torch.dtype:
        hit = pattern.search(name)
        return plan[groups[hit.lastgroup]] if hit else built[name]

    return dtype_of


def _tie(model: nn.Module, reader: conversion.Reader, hf_logger) -> None:
    """Tie weights on the meta model as transformers' tie_weights does after loading: a pair the checkpoint
    holds twice with different values stays untied (with transformers' warning)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in list(tied.items()):
        if target in reader.sources and source in reader.sources and not conversion.equal(reader, source, target):
            hf_logger.warning(
                f"The tied weights mapping and config for this model specifies to tie {source} to {target}, but both "
                "are present in the checkpoints with different values, so we will NOT tie them. You should update the "
                "config with `tie_word_embeddings=False` to silence this warning.")
            tied.pop(target)
    model.tie_weights(recompute_mapping=False)


def _holders(model: nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """Every parameter and buffer once, with all its names (tied tensors have several)."""
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        by_id.setdefault(id(t), (t, []))[1].append(name)
    return list(by_id.values())


def _missing(model: nn.Module, sources: dict) -> set[str]:
    """State-dict keys the checkpoint does not give, as transformers counts them after tying: a tied
    tensor is not missing when one of its names is in the checkpoint."""
    state = set(model.state_dict())
    missing = set()
    for _, names in _holders(model):
        if not any(n in sources for n in names):
            missing.update(n for n in names if n in state)
    return missing


def _initialize_missing(model: nn.Module, missing: set[str], device: torch.device) -> None:
    """transformers' own steps, on the full-size model: what the checkpoint gives stays on meta (marked
    loaded); missing tensors and non-persistent buffers are materialized on `device` and initialized."""
    for t, names in _holders(model):
        if not any(n in missing for n in names):
            t._is_hf_initialized = True
    model._move_missing_keys_from_meta_to_device(missing, {"": device}, None, None)
    model._initialize_missing_keys(False)
    model.tie_weights(recompute_mapping=False)  # materializing replaced tied tensors; tie them again


def _load_whole(model: nn.Module, plan, rank: int, reader: conversion.Reader, sources: dict) -> int:
    """Read every tensor that stays whole on this rank into the model; return how many tensors this
    rank reads in all (these and the split ones, read later by the plan)."""
    split: set[str] = set()
    dropped: tuple[str, ...] = ()
    if plan is not None:
        for shard in plan.params.values():
            split.update((shard.name, *shard.aliases))
        dropped = tuple(f"{t.name}.{i}." for t in plan.tensors if t.holder == "modules"
                        for i in range(t.full_shape[0]) if i not in t.indices(rank))
    count = 0
    for t, names in _holders(model):
        stored = any(n in sources for n in names)
        if t.device.type != "meta" and not stored:
            continue  # initialized here, and not in the checkpoint (a computed buffer)
        # (a tensor built outside the meta-device context, e.g. XLNet's legacy torch.FloatTensor parameters,
        # is real but uninitialized memory: read it from the checkpoint like the others)
        if dropped and all(n.startswith(dropped) for n in names):
            continue  # in an item of a ModuleList that another rank keeps
        count += 1
        if any(n in split for n in names):
            continue  # read by the plan
        name = next((n for n in names if n in sources), None)
        assert name is not None, f"{names[0]} is neither in the checkpoint nor initialized"
        value = reader.whole(name)
        new = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
        for n in names:
            owner, _, attr = n.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)
    return count


def _check_materialized(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    assert not left, f"tensors left on the meta device after loading: {left[:5]}"


def _agree(failure: Exception | None, tp_size: int, group, device: torch.device) -> None:
    """Every rank learns whether any rank failed while reading; a rank that failed raises its error,
    the others a OtherRankError, so none goes on to wait in a collective that a failed rank never joins."""
    if tp_size > 1:
        on = device if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
        flag = torch.tensor([0 if failure is None else 1], device=on)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if failure is None and flag.item():
            raise OtherRankError("tpmap.from_pretrained failed on another rank (its error says why); this rank's "
                                 "model is incomplete there, so it is not returned")
    if failure is not None:
        raise failure


def _progress(rank: int, desc: str):
    """A tqdm bar on rank 0 for loads over a few seconds; silent when stderr is not a terminal, on other
    ranks, and when transformers' progress bars are disabled."""
    from transformers.utils import logging as hf_logging

    return hf_logging.tqdm(total=0, desc=desc, unit="tensor", disable=True if rank else None, delay=2.0)
