"""Naming tables: names of projections, attributes and config keys (never of models), and the tiny sizes."""
from __future__ import annotations

import re

Q_NAMES = {"q_proj", "query", "q", "wq", "q_lin", "query_proj", "q_head", "q_linear"}
K_NAMES = {"k_proj", "key", "k", "wk", "k_lin", "key_proj", "k_head", "k_linear"}
V_NAMES = {"v_proj", "value", "v", "wv", "v_lin", "value_proj", "v_head", "v_linear"}
QKV_NAMES = {"qkv_proj", "c_attn", "query_key_value", "wqkv", "qkv", "in_proj", "w_pack", "qkv_linear", "att_proj"}
KV_NAMES = {"kv_proj", "key_value", "kv"}
O_NAMES = {"o_proj", "out_proj", "o", "out_lin", "attn_out"}  # in an attention scope: never an MLP's Row
ATTENTION_SCOPE = re.compile(r"att", re.IGNORECASE)  # attn, self_attn, attention, SelfAttention, ...

TINY = {"hidden": 96, "heads": 12, "kv_heads": 4, "head_dim": 8, "intermediate": 192, "layers": 2,
        "vocab": 256, "positions": 64, "experts": 4, "experts_per_token": 2, "expert_groups": 1}
CONFIG_KEYS = {  # config keys by the size they hold (the whole key must match)
    "kv_heads": r"num_key_value_heads|num_kv_heads|n_kv_heads|num_kv|multi_query_group_num|\w*key_value_heads",
    "heads": r"n_head|n_heads|num_heads|\w*attention_heads",
    "layers": r"n_layer|num_layers|\w*layers",
    "hidden": r"hidden_size|n_embd|n_embed|d_model|dim|embed_dim|model_dim|hidden_dim",
    "head_dim": r"head_dim|d_kv|kv_channels|attention_head_size|d_head",
    "intermediate": r"\w*intermediate_size|\w*ffn_dim|d_ff|n_inner|ffn_hidden_size|inner_hidden_size|"
                    r"intermediate_dim|mlp_dim|dim_feedforward|d_inner",
    "vocab": r"vocab_size",
    "positions": r"max_position_embeddings|n_positions|n_ctx|max_seq_len|max_sequence_length|max_target_positions",
    "experts": r"num_experts|num_local_experts|n_routed_experts|moe_num_experts",
    "experts_per_token": r"num_experts_per_tok|moe_top_k|moe_k|top_k|num_selected_experts",
    "expert_groups": r"n_group|topk_group|num_expert_group",
    "rotary_dim": r"rotary_dim",
}
CAPPED = ("layers", "experts", "experts_per_token", "expert_groups", "positions")  # lowered to TINY, never raised
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # other ids: 3
SIZE_ATTRIBUTE = re.compile(r"head|embed|dim|size|width|hidden|group|inner|split|intermediate|ffn|channel")
PER_HEAD_ATTRIBUTE = re.compile(r"(attention_)?head_(dim|size|width)|\w*(per_head|rot|rope)\w*|d_head|d_kv")
PLAN_COLUMN = {"colwise": {}, "packed_colwise": {"sections": 2}, "colwise_gather_output": {"gather_output": True}}
PLAN_ROW = {"rowwise": {}}
CLASS_MAPPINGS = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                  "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
CLASS_SUFFIXES = ("ForCausalLM", "Model")  # for config classes the auto mappings do not list
WORLD_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
