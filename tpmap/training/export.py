"""`tpmap.training.export`: a training checkpoint as a standard transformers folder, without starting ranks.

The model is built on the meta device from the saved config (structure and names only); each full tensor is
assembled from the rank files that hold its pieces (`reshard.Reader` with a whole layout: only the stored
pieces, padding never read), reverted to the checkpoint format and written, one tensor (or one conversion
group, e.g. one layer's experts) at a time, by the same steps as `tpmap.save_pretrained` (`checkpoint.save`'s
layout, file split and config writing), so the folder equals what tpmap.save_pretrained writes for the same
weights and loads with plain ``AutoModelForCausalLM.from_pretrained``. Optimizer state and RNG are dropped.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tpmap.checkpoint import save as hf_save
from tpmap.checkpoint.safetensors import SAFE_WEIGHTS_NAME, SafetensorsFile, SafetensorsWriter
from tpmap.training import files
from tpmap.training.errors import TrainingCheckpointError
from tpmap.training.reshard import Reader


def export(checkpoint, out_dir, *, max_shard_size="50GB") -> Path:
    """Write the model of training checkpoint `checkpoint` (a save directory or one step folder) to `out_dir` as
    transformers' save_pretrained does. One process, no process group; reads each stored piece once."""
    folder = files.resolve(checkpoint)
    manifest = files.read_manifest(folder)
    if manifest["peft"]:
        raise TrainingCheckpointError(f"{folder} holds a LoRA (tpmap.peft) model; export writes full models only: "
                                      "resume it and save the adapters with tpmap.peft.save_pretrained")
    files.check_files(folder, manifest, sorted(manifest["files"]), hash_these=set(manifest["files"]))
    model = meta_model(manifest)
    layout = _layout(model, manifest)
    keep = hf_save._kept_names(model, layout)
    groups = hf_save._conversion_groups(model, keep)
    outputs = hf_save._outputs(model, layout, groups, True)
    file_of = hf_save._assign_files(outputs, SAFE_WEIGHTS_NAME, max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list] = {}
    for name, file in file_of.items():
        shape, dtype = outputs[name]
        by_file.setdefault(file, []).append((name, dtype, shape))
    names = [files.tensor_file(t, manifest["tp_size"]) for t in range(manifest["tp_size"])]
    reader = Reader([SafetensorsFile.parse(folder / n) for n in names], manifest)
    writers = {f: SafetensorsWriter(out / f, entries, {"format": "pt"}) for f, entries in by_file.items()}
    try:
        for group in groups:
            full = {}
            for name in group:
                shape, dtype, key = layout[name]
                full[name] = torch.empty(shape, dtype=dtype)
                reader.fill(key, None, 0, full[name])
            for out_name, tensor in hf_save._revert(model, full, layout).items():
                writers[file_of[out_name]].write(out_name, tensor)
    finally:
        reader.close()
        for w in writers.values():
            w.close()
    hf_save._save_configs(model, out, file_of, outputs, layout, None, 0)
    return out


def meta_model(manifest: dict):
    """The saved model class built from the saved config on the meta device, in the saved dtype."""
    import transformers
    from transformers import CONFIG_MAPPING, GenerationConfig

    config = CONFIG_MAPPING[manifest["model_type"]].from_dict(manifest["config"])
    cls = getattr(transformers, manifest["model_class"], None)
    if cls is None:
        raise TrainingCheckpointError(f"the checkpoint's model class {manifest['model_class']} is not in the installed "
                                      f"transformers {transformers.__version__}")
    dtypes = [v["dtype"] for k, v in manifest["tensors"].items() if k.startswith("model/")]
    dtype = next((getattr(torch, d) for d in dtypes if getattr(torch, d).is_floating_point), torch.float32)
    with torch.device("meta"):
        model = cls(config).to(dtype)
    if manifest["generation_config"] is not None:
        model.generation_config = GenerationConfig.from_dict(manifest["generation_config"])
    return model


def _layout(model, manifest: dict) -> dict:
    """save_pretrained's layout of the unsharded model: name -> (full shape, dtype, stored key), in its order."""
    out = {}
    for name in model.state_dict():
        key = "model/" + manifest["aliases"].get(name, name)
        info = manifest["tensors"].get(key)
        if info is None:
            raise TrainingCheckpointError(f"the checkpoint has no tensor {name}, which {manifest['model_class']} has: "
                                          "it was saved from another model class or transformers release")
        out[name] = (tuple(info["full_shape"]), getattr(torch, info["dtype"]), key)
    return out
