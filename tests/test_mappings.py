"""Every shipped mapping proven on real ranks against the unsharded model, computed in the same run:
for every embedded verify config, class and world size > 1 the forward (logits within verify.RTOL);
for the first config also per-shard gradients at world sizes 2 and 4: fp32 at 2, with greedy generate for
classes that generate, fp64 at 4 (where only one of them is listed, all of it there). One rank round trip
per (mapping, config, class, world size), so a new mapping is proven by adding its YAML file.
(Both dtypes and generate at both sizes, as before 2026-12-07, cost 9 minutes of CI's full tier: generate at 4 is
proven on the core families with a static cache in test_training.py, replicated KV heads included, and at an
uneven split in test_uneven.py; a wrong gradient at 4 fails fp64 as surely as fp32.)

Gradient tolerances: fp32 1e-4 and fp64 2e-6 relative, per parameter at its own scale, above a noise floor
of 64 eps of its module's largest gradient (rank_cases._grad_report). Transformers' norms compute in
float32 whatever the dtype, so fp64 runs keep fp32 rounding there: measured up to 1.01e-6 (OLMoE's
k_norm at world size 2; each mapping draws its own example ids), hence 2e-6 here against
tests/test_training.py's 1e-6 on a few fixed cases;
T5-style unscaled attention saturates at init std 0.2 and gets 1e-3 in fp32.
"""
from __future__ import annotations

import re

import pytest
import rank_cases
import torch  # noqa: F401  (rank_cases needs it importable)

from tpmap import verify
from tpmap.language import source

GENERATES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "WithLMHead", "MTModel")  # Reformer, Marian
GRAD_RTOL = {"grad_fp32": 1e-4, "grad_fp64": 2e-6}
# fp32 rounding amplified, the fp64 check (1e-6) still exact: T5's unscaled attention (see test_training.py);
# Reformer's reversible layers recompute activations in backward, from sums rounded in another order
# (measured 1.07e-4 at ws 2; fp64 ~1e-13)
# Gemma3n's activation-sparse layers cut at mean + z * std of the gathered gate output: an element within
# rounding of the cutoff flips (measured 6.1e-4 at ws 4 with its example ids, <= 1.2e-4 with 5 other seeds;
# 1.02e-3 on layer 9's up_proj at ws 4 since composition landed, which failed CI at 10x: 30x, fp64 still 2e-6)
# PaliGemma (Gemma text model, SigLIP tower, through the image tokens): layer 0's k_proj gradient, judged at its own
# scale, reaches 1.80e-4 at ws 4 in fp32 (measured 2026-12-02 and again after siglip's return); fp64 of the same case
# within 2e-6, the forward 4.3e-6
# Switch Transformers has T5's unscaled attention: 1.07e-4 on encoder layer 0's q at ws 4 once the shared-memory
# path summed the ranks in rank order instead of gloo's ring order (fp64 still within 2e-6)
# Qwen3.5-MoE vision-language: Qwen3_5MoeModel's token-embedding gradient at ws 4, 1.70e-4 in fp32 (the image
# features through the Gated DeltaNet's float32 kernel and the routed experts; its forward is 4.6e-5, a declared
# tolerance), the fp64 check of the same case within its bound
# granite_speech(_plus): the Conformer encoder (BatchNorm, Shaw positions, a CTC softmax fed back into the stream)
# and the Q-Former amplify fp32 rounding into the language model: 1.07e-4 on language_model.layers.1 k_proj at
# ws 2; the same cases' fp64 gradients pass the 1e-6 bound
# MiniCPM-V 4.6 (Qwen3.5's Gated DeltaNet behind the image path, as qwen3_5_moe): layer 0's linear_attn.in_proj_qkv
# weight 1.008e-4 in fp32 with the merger MLP split; the fp64 check of the same case within its bound (LOOSE_FP64)
# HY-V4-VL: the hyper-connections (whole, outside the split blocks) force float32 (`.float()` with autocast off)
# whatever the dtype, and their gradients gather every split block's contribution through the image path:
# hc_head.hc_scale 1.09e-4 (ws 2) and 1.60e-4 (ws 4) in fp32, the forward 2e-6; in fp64 (same float32 casts)
# layer 0's attn_hc.fn 2.99e-6 at ws 2 (LOOSE_FP64), every other parameter within 2e-6
# Granite-4-Vision: five Window Q-Former projectors (softmaxes over 4 x 4 windows under the large init) summed into
# the image tokens at five decoder layers; the unsharded fp32 model's own gradients are O(1) from float64 on the
# vision tower's and the Q-Formers' q/k weights: 9.3e-4 (spatial_projectors.0 cross-attention query) at ws 2 in
# fp32, while the fp64 check of the same case is 3.1e-12
# PP-FormulaNet: the image features pass the SAM neck's channel LayerNorms and two convs before the decoder, whose
# cross-attention reads only 4 image positions (a saturated softmax under the large init); the unsharded fp32
# model's own logits are 2.7e-5 from float64 (a declared forward tolerance): at ws 2 in fp32 the neck's layer_norm2
# weight gradient 1.70e-4 and decoder.layers.1.encoder_attn.q_proj.bias 1.03e-3 (over 10x); the fp64 check of the
# same case within its bound
LOOSE_FP32 = {"t5": 10, "reformer": 10, "gemma3n_text": 30, "paligemma": 10, "switch_transformers": 10,
              "qwen3_5_moe": 10, "granite_speech": 10, "granite_speech_plus": 10, "minicpmv4_6": 10, "hy_v4_vl": 10,
              "granite4_vision": 10, "pp_formulanet": 30,
              # Inkling 2 Loop runs its looped layers twice over, which compounds float32 rounding: at ws 4 (kv4) layer
              # 0's relative_position_bias.linear.weight 1.09e-4, with the very pieces main planned (it passed at
              # 1e-4 there) once kv4 also listed ws 3 and so drew other example ids (vocabulary boundaries at 3); no
              # fp64 check can run (the router's weight stays float32 under .double(): not_checked grad_fp64)
              "inkling2_loop_text": 10}
# fp64 bound x factor for the parameters matching a pattern. Qwen3.5's Gated DeltaNet keeps float32 inside an
# fp64 run (the chunked delta rule casts q/k/v/beta/decay to float32, the decay is -A_log.float().exp() * ...,
# the gated norm and the decoder RMSNorms compute in float32), and A_log's gradient (2 heads per rank at ws 4,
# judged at its own scale) amplifies that rounding: measured at ws 4 with the mappings' example ids 2.35e-6
# (qwen3_5_text) and 3.80e-6 (qwen3_5_moe_text), 1.01e-5 for the MoE with only the delta rule's casts made
# fp64 (the RMSNorms' float32 left), and 0.0 for every parameter of both once all those casts keep float64;
# the next largest 7.1e-7 (the MoE's in_proj_b on rank 0), A_log exact at ws 2.
# OLMo-Hybrid's Gated DeltaNet layers are the same kernel: A_log 2.22e-6 at ws 4 with the ranks summed in rank order.
# The Qwen3.5 vision-language models run the same text models behind the image path: A_log 2.70e-6 (qwen3_5) and
# the MoE's layer-0 conv1d weight, whose output enters the same float32 delta rule, 2.11e-6 (qwen3_5_moe), at ws 4.
LOOSE_FP64 = {"qwen3_5_text": (r"\.linear_attn\.A_log$", 10), "qwen3_5_moe_text": (r"\.linear_attn\.A_log$", 10),
              "olmo_hybrid": (r"\.linear_attn\.A_log$", 10), "qwen3_5": (r"\.linear_attn\.A_log$", 10),
              "qwen3_5_moe": (r"\.linear_attn\.(A_log|conv1d\.weight)$", 10),
              # MiniCPM-V 4.6's Qwen3.5 text model behind its image path, the same float32 delta rule: at ws 4
              # A_log 6.33e-6, layer 0's in_proj_qkv weight 2.67e-6 and conv1d weight 2.54e-6 (feeding the rule);
              # dt_bias (in the rule's float32 decay) 2.23e-6 once the merger MLP is split too
              "minicpmv4_6": (r"\.linear_attn\.(A_log|dt_bias|in_proj_qkv\.weight|conv1d\.weight)$", 10),
              # MiniCPM-V 4.7: the same language model and float32 delta rule (ws 4: A_log 2.14e-6 in fp64; in_proj_a,
              # the rule's decay input, 2.31e-6 with the DeltaNet split on key-head groups)
              "minicpmv4_7": (r"\.linear_attn\.(A_log|dt_bias|in_proj_(qkv|a)\.weight|conv1d\.weight)$", 10),
              # MiniCPM-OCR: MiniCPM-V 4.6's architecture, the same float32 delta rule (ws 4 in fp64: layer 0's A_log
              # 1.02e-5 for the ForConditionalGeneration, dt_bias 8.97e-6 for the base model; its fp64 forward at
              # ws 2 is 3.2e-16, fp32 forward and gradients within their bounds)
              "minicpm_ocr": (r"\.linear_attn\.(A_log|dt_bias|in_proj_qkv\.weight|conv1d\.weight)$", 10),
              # HY-V4-VL: the hyper-connections' float32 mixing weights (see LOOSE_FP32's comment)
              "hy_v4_vl": (r"\.(attn|ffn)_hc\.fn$", 10),
              # DeepSeek-V4: the same float32 hyper-connections (its HC modules are cast to float32 and the
              # forward calls .float() on the streams and fn, so an fp64 run mixes in float32): at ws 2
              # layer 0's attn_hc.scale 2.74e-6 in fp64 (fp32 check within its bound); the HCs are whole
              "deepseek_v4": (r"(\.(attn|ffn)_hc\.(fn|base|scale)|hc_head\.hc_(fn|base|scale))$", 10)}


def _worst_over_bound(ref: str, key: str, g: dict) -> tuple[float, str]:
    """The largest rel / (its parameter's loosening factor) and its parameter: judged against the plain bound."""
    pattern, factor = LOOSE_FP64.get(ref, ("$^", 1)) if key == "grad_fp64" else ("$^", 1)
    scaled = {name: rel / (factor if re.search(pattern, name) else 1) for name, rel in g["rels"].items()}
    name = max(scaled, key=scaled.get, default="")
    return scaled.get(name, 0.0), name
# How the unsharded model fails each check a verify config declares `not_checked` (its reason, as the
# exception or non-finite result it raises): the claim is proven only by that failure, not by any failure
NOT_CHECKED_FAILS = {
    ("fsmt", "mha12", "grad_fp64"): r"^RuntimeError: value cannot be converted to type float without overflow",
    ("blip", "mha12", "generate"): r"^ValueError: not enough values to unpack \(expected 4, got 2\)",
    ("kosmos-2", "mha12", "grad_fp64"): r"^RuntimeError: value cannot be converted to type float without overflow",
    ("xglm", "mha12", "grad_fp64"): r"^RuntimeError: value cannot be converted to type float without overflow",
    ("prophetnet", "ngram2", "grad_fp64"): r"^non-finite loss nan ",
    ("inkling2_loop", "kv4", "grad_fp64"): r"^RuntimeError: expected m1 and m2 to have the same dtype, but got: "
                                           r"float != double",
    ("inkling2_loop_text", "kv4", "grad_fp64"): r"^RuntimeError: expected m1 and m2 to have the same dtype, but got: "
                                                r"float != double",
    ("inkling2", "kv4", "grad_fp64"): r"^RuntimeError: expected m1 and m2 to have the same dtype, but got: "
                                      r"float != double",
    ("inkling2_text", "kv4", "grad_fp64"): r"^RuntimeError: expected m1 and m2 to have the same dtype, but got: "
                                           r"float != double",
    ("mra", "tiny", "grad_fp64"): r"^RuntimeError: mat1 and mat2 must have the same dtype, but got Float and Double",
    ("gemma4_audio", "mha12", "grad_fp64"): r"^RuntimeError: expected scalar type Double but found Float",
    # dots3-note's vision experts stay on grouped_mm (no float64 kernel): set_experts_implementation("eager") does
    # not reach them, in the tower alone or in the composite model; nor Nemotron 3.5 Transcribe's language model's
    **{(ref, name, "grad_fp64"): r"^RuntimeError: Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double"
       for ref, name in (("dots3_note", "dsa-swa"), ("dots3_note_vision_encoder", "mha12-moe"),
                         ("nemo_speechlm", "hybrid-chunks"))},
    ("reformer", "causal-local-lsh", "generate"): r"^RuntimeError: einsum\(\): the number of subscripts in the "
                                                  r"equation \(4\) does not match the number of dimensions \(5\)",
    # its generate caps max_length at the audio's token count, which the prompt already fills; without the audio
    # every forward refuses to run
    **{("voxtral_realtime", name, "generate"): r"^ValueError: (Input length of input_ids is \d+, but `max_length` is "
                                               r"set to \d+|You must specify exactly one of input_features or "
                                               r"encoder_inputs_embeds)" for name in ("gqa-kv4", "gqa-kv3")},
}


def _grads(spec, full: bool) -> tuple[str, ...]:
    """The gradient checks of a deep case: fp32 with the full set (and fp64 too where no other deep size is listed),
    fp64 at the other deep size (fp32 where fp64 cannot run)."""
    if full:
        return ("grad_fp32", "grad_fp64") if not {2, 4} <= set(spec.world_sizes) else ("grad_fp32",)
    # not_checked fp64: fp32 here, and prove_case shows the unsharded model failing fp64 as declared
    return ("grad_fp32", "grad_fp64") if "grad_fp64" in spec.not_checked else ("grad_fp64",)


def _cases():
    out = []
    for model_type in source.shipped_files():
        mapping = verify.resolve(model_type).mapping
        for index, spec in enumerate(mapping.verify):
            for cls in spec.models:
                for ws in spec.world_sizes:
                    if ws == 1:
                        continue  # apply returns the model unchanged; lint checks the plan at 1
                    deep = index == 0 and ws in (2, 4)
                    # the full set (fp32 gradients, generate) at 2, or at 4 where 2 is not listed;
                    # the other deep size: fp64 gradients (the replicated KV heads' summed gradients at 4)
                    full = deep and (ws == 2 or 2 not in spec.world_sizes)
                    generate = full and cls.endswith(GENERATES)
                    out.append(pytest.param(model_type, index, cls, ws, deep, generate, _grads(spec, full),
                                            id=f"{model_type}-{spec.name}-{cls}-ws{ws}"))
                    if deep and "parallel" in verify.other_placements(model_type, index):
                        # whole experts per rank: forward here at 2 and 4, generate with the full set, every
                        # gradient in test_expert_parallel
                        out.append(pytest.param(f"{model_type}{verify.PLACEMENT}parallel", index, cls, ws, False,
                                                generate, (), id=f"{model_type}-{spec.name}-{cls}-ws{ws}-parallel"))
    return out


CASES = _cases()


@pytest.mark.parametrize("ref,index,cls,ws,training,generate,grads", CASES)
def test_mapping_is_exact_on_real_ranks(ranks, ref, index, cls, ws, training, generate, grads):
    per_rank = ranks(ws).run(rank_cases.prove_case, ref, index, cls, training, generate, grads)
    case = verify.Case(ref=ref, model_type=ref, verify_index=index,
                       config_name=verify.resolve(ref).mapping.verify[index].name, class_name=cls, world_size=ws)
    result = verify.judge(case, [r["forward"] for r in per_rank])
    assert result.passed, result.error
    name = verify.resolve(ref).mapping.verify[index].name
    for rank, r in enumerate(per_rank):
        # each rank holds exactly what the mapping says, counted from the unsharded model and the reference
        assert r["forward"]["params_local"] == r["share"]["expected_local"] < r["share"]["full"], (rank, r["share"])
        assert r["share"]["whole_in_blocks"] == [], ("kept whole without a replicated pattern", r["share"])
        for key, rtol in GRAD_RTOL.items():
            if key in r:
                bound = rtol * (LOOSE_FP32.get(ref, 1) if key == "grad_fp32" else 1)
                g = r[key]
                # every parameter compared, every split one against its reference slice
                assert g["checked"] == g["params"] and g["sharded"] == g["expected_sharded"], (key, g)
                assert g["sharded"] and set(g["reshaped"]) <= set(g["sharded"]), (key, g)
                worst, worst_name = _worst_over_bound(ref, key, g)
                assert worst <= bound, (key, worst, worst_name, g["worst_rel"], g["worst_name"])
                assert g["loss_diff"] <= 1e-5 * max(1.0, abs(g["loss"])), (key, g)
        for check in ("grad_fp64", "generate"):  # declared not_checked: the unsharded model must fail as documented
            error = r.get(f"{check}_unsharded_error", "")
            if f"{check}_unsharded_error" in r:
                assert error, (f"{ref}: the unsharded model now passes {check}; "
                               f"remove not_checked: {check} from its verify config")
                assert re.search(NOT_CHECKED_FAILS[(ref, name, check)], error), (
                    f"{ref} {name}: the unsharded model fails {check} otherwise than documented: {error}")
        if "generate" in r:
            assert r["generate"]["new_tokens"] >= 20 and r["generate"]["ranks_agree"], r["generate"]
            assert r["generate"]["same_as_full"], r["generate"]


@pytest.mark.parametrize("model_type", list(source.shipped_files()))
def test_each_mapping_is_proven_at_world_sizes_2_and_4_with_gradients(model_type):
    """Every mapping claims world sizes 2 and 4 somewhere, and its first config gets the training checks."""
    ws = {c.values[3] for c in CASES if c.values[0] == model_type}
    deep = [c for c in CASES if c.values[0] == model_type and c.values[4]]
    assert {2, 4} <= ws, f"{model_type} is verified only at world sizes {sorted(ws)}"
    assert deep, f"{model_type}: its first verify config lists neither world size 2 nor 4"
    grads = {key for c in deep for key in c.values[6]}
    assert grads == {"grad_fp32", "grad_fp64"}, f"{model_type}: gradients proven only in {sorted(grads)}"


def test_every_not_checked_claim_names_the_failure_that_proves_it():
    """A verify config's `not_checked` entry is proven by one documented failure (NOT_CHECKED_FAILS), which
    prove_case matches; a new entry needs its failure written down."""
    declared = {(m, spec.name, check) for m in source.shipped_files() for spec in verify.resolve(m).mapping.verify
                for check in spec.not_checked}
    assert declared == set(NOT_CHECKED_FAILS)


@pytest.mark.parametrize("model_type", [t for t in source.shipped_files()
                                        if verify.resolve(t).mapping.config_defaults])
def test_each_declared_config_default_is_proven_on_a_config_that_lacks_the_attribute(model_type):
    """`config_defaults` exists for configs without the attribute (DeBERTa-v2 without share_att_key): a verify
    config must leave it out, so the absent case runs on real ranks, not only the case that sets it."""
    mapping = verify.resolve(model_type).mapping
    for key in mapping.config_defaults:
        assert any(key not in spec.config for spec in mapping.verify), (
            f"{model_type}: every verify config sets {key!r}; leave it out of one to prove the default")
