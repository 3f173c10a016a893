"""tpmap.from_pretrained and tpmap.save_pretrained on real gloo ranks, for every shipped mapping.

* Loading: each rank's parameters and buffers are bit-identical to `tpmap.apply` on the model
  transformers' `from_pretrained` loads (ties, missing weights initialized from the same seed,
  unexpected keys, generation config and loading info alike), and to the independent reference's
  slices of that unsharded model (tests/slicing_reference.py: apply shares the plan with the loader),
  from a checkpoint sharded into many files, at world sizes 2 and 4 (the first verify config of each
  mapping; a mapping added later is tested by being shipped). At 2, rows are read in blocks of a few
  rows, and one checkpoint holds a tensor larger than a default block; at 4, every run is read on its
  own and each rank reads no more bytes than it keeps: only its slices. (The check at 2 runs on the
  checkpoint the save test below writes at 4, where a mapping runs at 4.)
* Saving (the first verify config's first class): apply -> tpmap.save_pretrained writes the files
  transformers' save_pretrained writes for the unsharded model, loads back bit-identical with plain
  transformers, and tpmap.from_pretrained at another world size gives the unsharded logits. (Every class
  was saved until 2026-12-07: 2.5 minutes of CI for heads that the load test reads at 4 and
  save_pretrained gathers as any other split tensor.)
* Conversions, ties, dtypes, key mappings; every bad checkpoint (missing shard or tensor, shape against
  the config, truncated file, .bin only, unknown model type) raises the same clear error on every rank.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import checkpoint_cases as cases
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import tpmap
from tpmap import verify
from tpmap.language import source


def _shipped() -> list[tuple[str, int]]:
    """(model type, world size) of the load test: 4, and 2 where the save test does not load at 2 (it saves at 4
    where it can, then runs the same check at 2 on what it saved, the first class's checkpoint)."""
    out = []
    for model_type in source.shipped_files():
        sizes = verify.resolve(model_type).mapping.verify[0].world_sizes
        out += [(model_type, ws) for ws in (2, 4) if ws in sizes and (ws == 4 or 4 not in sizes)]
    return out


SHIPPED = _shipped()
# mappings that split no tensor along a dim after its first (no Row, no fused experts): every slice is
# one run, never read in blocks of rows
ONE_RUN_SLICES = {"squeezebert"}
MODEL_TYPES = list(dict.fromkeys(m for m, _ in SHIPPED))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """model type -> a folder holding its first verify config's first class, in 64 KB shards."""
    made: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in made:
            spec = verify.resolve(model_type).mapping.verify[0]
            folder = tmp_path_factory.mktemp(f"checkpoint-{model_type}")
            verify.build_model(model_type, 0, spec.models[0]).save_pretrained(folder, max_shard_size="64KB")
            assert len(list(folder.glob("*.safetensors"))) > 1  # really sharded, with an index
            made[model_type] = folder
        return made[model_type]

    return get


def _classes(model_type: str) -> list[str]:
    return verify.resolve(model_type).mapping.verify[0].models


@pytest.mark.parametrize("model_type,ws", SHIPPED, ids=lambda v: v if isinstance(v, str) else f"ws{v}")
def test_from_pretrained_equals_apply_on_the_loaded_model(ranks, checkpoint, model_type, ws):
    """At 2, rows with small gaps are read in blocks of 5 rows (tiny tensors would fit one 16 MiB block,
    where a wrong block offset never shows); at 4, run by run, so the bytes read are exactly the slices."""
    gap, rows = (0, None) if ws == 4 else (None, 5)
    per_rank = ranks(ws).run(cases.from_pretrained_equals_apply, str(checkpoint(model_type)), _classes(model_type),
                             gap_bytes=gap, block_rows=rows)
    _assert_equals_apply(per_rank, model_type, ws)


def _assert_equals_apply(per_rank: list[dict], model_type: str, ws: int) -> None:
    for rank, results in enumerate(per_rank):
        for cls, r in results.items():
            assert r["differ"] == [], (rank, cls, r["differ"][:5])
            assert r["differ_reference"] == [] and r["compared_reference"], (rank, cls, r["differ_reference"][:5])
            assert r["ties_equal"] and r["generation_equal"] and not r["training"], (rank, cls)
            assert r["info_equal"], (rank, cls, r["info"])
            if ws == 4:
                assert 0 < r["read"] <= r["kept"], (rank, cls, r["read"], r["kept"])
            elif model_type not in ONE_RUN_SLICES:  # the block path ran, over several blocks per tensor
                assert r["blocks"] > r["block_tensors"] > 0, (rank, cls, r["blocks"], r["block_tensors"])


def test_a_checkpoint_larger_than_a_block(ranks, tmp_path):
    """A down_proj of 17 MB, more than one default 16 MiB block, whose rows (66 KB) are read whole with
    their gaps at world size 2: two blocks, the second at a byte offset past the first. Default block size."""
    from transformers import AutoConfig, LlamaForCausalLM

    from tpmap.engine import slice_io

    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=16896, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=1, vocab_size=256)
    assert slice_io.BLOCK_BYTES < 256 * 16896 * 4  # down_proj [256, 16896] fp32
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    for results in ranks(2).run(cases.from_pretrained_equals_apply, str(tmp_path), ["LlamaForCausalLM"]):
        r = results["LlamaForCausalLM"]
        assert r["differ"] == [] and r["differ_reference"] == [], (r["differ"], r["differ_reference"])
        assert r["block_tensors"] >= 2 and r["blocks"] > r["block_tensors"], r  # o_proj in 1 block, down_proj in 2


def test_missing_and_unexpected_keys_are_those_transformers_reports(ranks, checkpoint):
    """BERT's checkpoint is a BertModel: the heads of the other classes are missing (initialized from the
    seed, bit-identical above) and the equality of the reports above is not vacuous."""
    results = ranks(2).run(cases.from_pretrained_equals_apply, str(checkpoint("bert")),
                           ["BertForSequenceClassification"])[1]["BertForSequenceClassification"]
    assert {"classifier.weight", "classifier.bias"} <= set(results["info"]["missing_keys"]), results["info"]
    assert results["differ"] == [] and results["info_equal"]


def test_missing_weights_that_are_split_are_drawn_as_transformers_draws_them(ranks, tmp_path):
    """A LlamaModel checkpoint loaded as LlamaForCausalLM: the LM head is missing, drawn at random on the
    full-size model from the seed (as transformers does), then split by the vocabulary."""
    verify.build_model("llama", 0, "LlamaModel").save_pretrained(tmp_path)
    for results in ranks(2).run(cases.from_pretrained_equals_apply, str(tmp_path), ["LlamaForCausalLM"]):
        r = results["LlamaForCausalLM"]
        assert r["info"]["missing_keys"] == ["lm_head.weight"], r["info"]
        assert r["differ"] == [] and r["info_equal"], r["differ"]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_from_pretrained_at_world_size_1_equals_transformers(checkpoint, model_type):
    for cls, r in cases.from_pretrained_equals_apply(str(checkpoint(model_type)), _classes(model_type)).items():
        assert r["differ"] == [] and r["ties_equal"] and r["info_equal"] and r["generation_equal"], (cls, r)


def test_a_float32_checkpoint_loaded_in_bfloat16(ranks, checkpoint):
    for results in ranks(2).run(cases.from_pretrained_equals_apply, str(checkpoint("llama")), ["LlamaForCausalLM"],
                                dtype="bfloat16", block_rows=1):  # one row per block
        r = results["LlamaForCausalLM"]
        assert r["differ"] == [] and r["differ_reference"] == [], (r["differ"][:5], r["differ_reference"][:5])
        assert r["blocks"] > r["block_tensors"] > 0, r


def test_loss_parallel_from_a_checkpoint(ranks, checkpoint):
    for r in ranks(2).run(cases.loss_parallel_loss, str(checkpoint("llama"))):
        assert r["same_loss"] and r["local_vocab"] == -(-r["vocab"] // 2), r


# -- saving ---------------------------------------------------------------------------------------------
def _saves() -> list[tuple[str, int]]:
    out = []
    for model_type in MODEL_TYPES:
        sizes = verify.resolve(model_type).mapping.verify[0].world_sizes
        out.append((model_type, 4 if 4 in sizes else 2))
    return out


def _read(folder: Path, name: str) -> bytes:
    return (folder / name).read_bytes()


@pytest.mark.parametrize("model_type,ws", _saves(), ids=lambda v: v if isinstance(v, str) else f"ws{v}")
def test_save_pretrained_writes_what_transformers_writes(ranks, tmp_path, model_type, ws):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping, get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    for cls in _classes(model_type)[:1]:  # the load test reads every class (at 4, or at 2 where 4 is not listed)
        ours, theirs = tmp_path / cls / "tpmap", tmp_path / cls / "transformers"
        ranks(ws).run(cases.save_sharded, model_type, 0, cls, str(ours), max_shard_size="64KB")
        full = verify.build_model(model_type, 0, cls)
        # a sub-model's conversion counts too (qwen3_5_moe's text model fuses its experts; its own type has none)
        converted = get_checkpoint_conversion_mapping(model_type) is not None or any(
            isinstance(c, WeightConverter) for c in get_model_conversion_mapping(full, add_legacy=False))
        full.save_pretrained(theirs, max_shard_size="64KB")
        # a standard checkpoint: plain transformers loads it back bit for bit, as it loads its own save
        # (not full.state_dict(): Marian's sinusoidal positions are recomputed on every load)
        loaded = getattr(transformers, cls).from_pretrained(ours).state_dict()
        want = getattr(transformers, cls).from_pretrained(theirs).state_dict()
        assert loaded.keys() == want.keys()
        assert all(loaded[k].dtype == want[k].dtype and torch.equal(loaded[k], want[k]) for k in want), cls
        for name in ("config.json", "generation_config.json"):
            assert (ours / name).exists() == (theirs / name).exists(), name
            if (theirs / name).exists():
                assert json.loads(_read(ours, name)) == json.loads(_read(theirs, name)), name
        index = "model.safetensors.index.json"
        assert set(json.loads(_read(ours, index))["weight_map"]) == set(json.loads(_read(theirs, index))["weight_map"])
        if not converted:  # converted tensors: transformers counts views of one gathered tensor once when splitting
            assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
            assert all(_read(ours, f) == _read(theirs, f) for f in os.listdir(theirs)), cls
        # and back into tensor parallelism at another world size: the unsharded logits; at 2 also every tensor
        # bit for bit against apply on transformers' load and the reference slices, read in blocks of 5 rows
        # (the load test's check at 2, on this checkpoint)
        if ws == 4:
            per_rank = ranks(2).run(cases.from_pretrained_equals_apply, str(ours), [cls], block_rows=5,
                                    logits_of=(model_type, 0))
            _assert_equals_apply(per_rank, model_type, 2)
            per_rank = [results[cls] for results in per_rank]
        else:
            per_rank = [cases.logits_from_pretrained(model_type, 0, cls, str(ours))]
        tolerance = verify.resolve(model_type).mapping.verify[0].tolerance  # a declared bound, as tpmap verify
        for r in per_rank:
            assert r["max_diff"] <= (tolerance.forward if tolerance else verify.RTOL) * r["scale"], (cls, r)


def test_a_single_file_save_is_byte_identical_to_transformers(ranks, tmp_path):
    """Default shard size: one model.safetensors, byte for byte, converted expert tensors included."""
    ours, theirs = tmp_path / "tpmap", tmp_path / "transformers"
    ranks(2).run(cases.save_sharded, "mixtral", 0, "MixtralForCausalLM", str(ours))
    verify.build_model("mixtral", 0, "MixtralForCausalLM").save_pretrained(theirs)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs)) == [
        "config.json", "generation_config.json", "model.safetensors"]
    assert _read(ours, "model.safetensors") == _read(theirs, "model.safetensors")


def test_save_pretrained_of_an_ordinary_model_is_transformers_save(tmp_path):
    model = verify.build_model("llama", 0, "LlamaForCausalLM")
    tpmap.save_pretrained(model, tmp_path / "a")
    model.save_pretrained(tmp_path / "b")
    assert _read(tmp_path / "a", "model.safetensors") == _read(tmp_path / "b", "model.safetensors")
    with pytest.raises(TypeError, match="max_shard_size"):
        tpmap.save_pretrained(model, tmp_path / "c", safe_serialization=False)


# -- conversions, ties, key mappings ---------------------------------------------------------------------
def _rewrite(folder: Path, rename) -> None:
    """Rename the tensors of a single-file checkpoint."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file({rename(k): v for k, v in tensors.items()}, path, metadata={"format": "pt"})


def test_experts_are_read_lazily_and_the_whole_conversion_fallback_gives_the_same_bits(ranks, checkpoint):
    folder = str(checkpoint("mixtral"))
    lazy = ranks(2).run(cases.from_pretrained_equals_apply, folder, ["MixtralForCausalLM"], gap_bytes=0)
    for r in ranks(2).run(cases.whole_conversions, folder, "MixtralForCausalLM"):
        assert r["differ"] == []
        # one warning per kind of conversion: gate_up_proj (stack, concat), down_proj (stack)
        assert len(r["warnings"]) == 2, r["warnings"]
        assert "transformers' MergeModulelist, Concatenate;" in r["warnings"][0], r["warnings"]
        assert r["read"] > lazy[0]["MixtralForCausalLM"]["read"]  # the fallback reads whole experts


def test_experts_stored_transposed_as_on_the_hub_are_read_as_transformers_reads_them(ranks, checkpoint, tmp_path):
    """Qwen3-VL-MoE's experts pass through ``Transpose(1, 2, check_dims=True)``, which transposes only a
    tensor whose shape is not the model's. Stored transposed (the Hub layout), down_proj [E, I, H] is
    transposed back, read lazily; the square gate_up_proj [E, 2I, H] with 2I == H is kept as stored, as
    transformers keeps it (a probe, never of the model's shape, would transpose it: the rows it chose were
    wrong). Each rank still reads only its slices."""
    folder = tmp_path / "hub-layout"
    shutil.copytree(checkpoint("qwen3_vl_moe"), folder)
    shapes = set()
    for path in folder.glob("*.safetensors"):  # 64 KB shards
        tensors = load_file(path)
        experts = [k for k in tensors if ".mlp.experts." in k]
        shapes |= {tuple(tensors[k].shape[1:]) for k in experts}
        save_file({k: v.transpose(1, 2).contiguous() if k in experts else v for k, v in tensors.items()}, path,
                  metadata={"format": "pt"})
    assert shapes == {(96, 96), (96, 48)}, shapes  # the square case is there
    for rank, r in enumerate(ranks(4).run(cases.from_pretrained_equals_apply, str(folder),
                                          ["Qwen3VLMoeForConditionalGeneration"], gap_bytes=0)):
        r = r["Qwen3VLMoeForConditionalGeneration"]
        assert r["differ"] == [] and r["differ_reference"] == [], (rank, r["differ"][:5], r["differ_reference"][:5])
        assert 0 < r["read"] <= r["kept"], (rank, r["read"], r["kept"])


def test_a_chunked_fused_tensor_is_read_row_by_row_and_the_fallback_gives_the_same_bits(ranks, tmp_path):
    """q, k, v stored as one tensor and chunked by a transformers conversion (three targets, each split
    its own way): each rank reads only its rows of each, no more than it keeps; converted whole and
    sliced (lazy conversions off), the same bits as transformers + apply, with a warning."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.for_model("llama", **{**verify.resolve("llama").mapping.verify[0].config,
                                              "num_key_value_heads": 12})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(config.num_hidden_layers):
        attn = f"model.layers.{layer}.self_attn."
        tensors[attn + "qkv_proj.weight"] = torch.cat([tensors.pop(attn + f"{x}_proj.weight") for x in "qkv"])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for r in ranks(2).run(cases.fused_qkv, str(tmp_path), lazy=True):
        assert r["differ"] == [] and r["differ_reference"] == [] and r["info_equal"], (r["differ"][:3], r["info"])
        assert r["warnings"] == [] and 0 < r["read"] <= r["kept"], (r["warnings"], r["read"], r["kept"])
    for r in ranks(2).run(cases.fused_qkv, str(tmp_path), lazy=False):
        assert r["differ"] == [] and r["info_equal"], (r["differ"][:3], r["info"])
        assert len(r["warnings"]) == 1 and "Chunk" in r["warnings"][0]


def test_tied_weights_stored_twice_with_different_values_stay_untied(ranks, tmp_path):
    """transformers unties a pair the config ties when the checkpoint holds both with different values."""
    model = verify.build_model("gpt2", 0, "GPT2LMHeadModel")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 2)  # no longer the embedding
    model.save_pretrained(tmp_path)
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")
    for results in ranks(2).run(cases.from_pretrained_equals_apply, str(tmp_path), ["GPT2LMHeadModel"]):
        r = results["GPT2LMHeadModel"]
        assert r["differ"] == [] and r["ties_equal"], r["differ"][:3]


def test_legacy_names_load_renamed_and_save_back_as_they_were(ranks, tmp_path):
    """transformers' legacy renames (LayerNorm.gamma -> .weight) load; saving after tpmap.from_pretrained
    reverts them as transformers' save does after its from_pretrained."""
    folder = tmp_path / "legacy"
    verify.build_model("bert", 0, "BertModel").save_pretrained(folder)
    _rewrite(folder, lambda k: k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                                         "LayerNorm.beta"))
    for results in ranks(2).run(cases.from_pretrained_equals_apply, str(folder), ["BertModel"]):
        assert results["BertModel"]["differ"] == [] and results["BertModel"]["info_equal"]
    ranks(2).run(cases.load_and_save, str(folder), str(tmp_path / "ours"), "BertModel")
    transformers.BertModel.from_pretrained(folder).save_pretrained(tmp_path / "theirs")
    names = set(load_file(tmp_path / "ours" / "model.safetensors"))
    assert any("gamma" in n for n in names)
    assert _read(tmp_path / "ours", "model.safetensors") == _read(tmp_path / "theirs", "model.safetensors")


def test_key_mapping_renames_as_in_transformers(ranks, tmp_path):
    verify.build_model("llama", 0, "LlamaForCausalLM").save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda k: k.replace("model.", "decoder.", 1))
    for results in ranks(2).run(cases.from_pretrained_equals_apply, str(tmp_path), ["LlamaForCausalLM"],
                                key_mapping={r"^decoder\.": "model."}):
        r = results["LlamaForCausalLM"]
        assert r["differ"] == [] and r["info_equal"] and not r["info"]["missing_keys"], r["info"]


# -- bad input: a clear error on every rank, before any collective ---------------------------------------
def _sharded(tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    verify.build_model("llama", 0, "LlamaForCausalLM").save_pretrained(folder, max_shard_size="64KB")
    return folder


def _drop_a_shard(folder: Path) -> str:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = sorted(set(index["weight_map"].values()))[1]
    os.remove(folder / name)
    return name


def _index_a_missing_tensor(folder: Path) -> str:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["model.layers.0.mlp.gate_proj.weight_extra"] = index["weight_map"]["model.embed_tokens.weight"]
    path.write_text(json.dumps(index))
    return "model.layers.0.mlp.gate_proj.weight_extra"


def _config_disagrees(folder: Path) -> str:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["intermediate_size"] //= 2
    path.write_text(json.dumps(config))
    return "model.layers.0.mlp.down_proj.weight"  # the first tensor whose shape the config changes


def _truncate(folder: Path) -> str:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = sorted(set(index["weight_map"].values()))[-1]
    with open(folder / name, "r+b") as f:
        f.truncate(os.path.getsize(folder / name) - 100)
    return name


def _bin_only(folder: Path) -> str:
    state = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
    for f in folder.glob("model*.safetensors*"):
        os.remove(f)
    torch.save(state, folder / "pytorch_model.bin")
    return "pytorch_model.bin"


BAD = {  # how to break a good folder -> (error type, what the message must name besides the returned name)
    "missing shard file": (_drop_a_shard, "CheckpointError", ["model.safetensors.index.json", "incomplete"]),
    "index names a missing tensor": (_index_a_missing_tensor, "CheckpointError", ["has no such tensor"]),
    "shape disagrees with the config": (_config_disagrees, "CheckpointError", [".safetensors:", "[96, 192]",
                                                                                "[96, 96]", "config.json"]),
    "truncated file": (_truncate, "CheckpointError", ["truncated", "tensor "]),
    ".bin-only checkpoint": (_bin_only, "CheckpointError", ["safetensors", "save_pretrained"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_the_same_clear_error_on_every_rank(ranks, tmp_path, case):
    break_it, error, words = BAD[case]
    folder = _sharded(tmp_path)
    named = break_it(folder)
    results = ranks(2).run(cases.load_error, str(folder), timeout=120)
    assert results[0] == results[1], results  # the same error on both ranks, and neither hung
    kind, message = results[0]["error"]
    assert kind == error, message
    assert named in message and all(w in message for w in words), message


def test_a_model_type_without_a_mapping(ranks, tmp_path):
    from transformers import AutoConfig, IBertForMaskedLM  # refused for good (docs/refused.md): no mapping ships

    IBertForMaskedLM(AutoConfig.for_model("ibert", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=64)).save_pretrained(tmp_path)
    results = ranks(2).run(cases.load_error, str(tmp_path), timeout=120)
    assert results[0] == results[1]
    assert results[0]["error"][0] == "UnknownModelTypeError" and "'ibert'" in results[0]["error"][1]


def test_a_rank_failing_while_reading_makes_every_rank_raise(ranks, tmp_path):
    folder = _sharded(tmp_path)
    results = ranks(2).run(cases.fails_on_one_rank, str(folder), timeout=120)
    assert results[1]["error"][0] == "OSError" and "simulated read error" in results[1]["error"][1]
    assert results[0]["error"][0] == "OtherRankError" and "another rank" in results[0]["error"][1]


def test_arguments_that_place_weights_another_way_are_refused(checkpoint):
    with pytest.raises(TypeError, match="device=") as e:
        tpmap.from_pretrained(checkpoint("llama"), device_map="auto")
    assert "device_map" in str(e.value)


def test_the_progress_bar_shows_only_on_rank_0_a_terminal_and_with_transformers_bars_on():
    from transformers.utils import logging as hf_logging

    from tpmap.checkpoint.load import _progress

    assert _progress(1, "x").disable  # other ranks
    assert _progress(0, "x").disable  # pytest's stderr is not a terminal
    hf_logging.disable_progress_bar()
    try:
        assert isinstance(_progress(0, "x"), hf_logging.EmptyTqdm)
    finally:
        hf_logging.enable_progress_bar()
