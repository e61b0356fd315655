"""Model dimensions the benchmarks share, one owner per model (the reference decoder's own configs, Llama-3-8B and
Qwen3-30B-A3B, live in `cutlass_w8a8.models.config`).

`GLM_45_AIR`: GLM-4.5-Air (transformers ``glm4_moe``), for bench/bench_hf.py ``--config glm-4.5-air`` (the whole
causal LM) and bench/_moe_block.py's ``glm-4.5-air`` row (its MoE block).
"""

from __future__ import annotations

__all__ = ["GLM_45_AIR", "glm_45_air_rope"]

#: GLM-4.5-Air's dimensions as ``transformers.Glm4MoeConfig`` keyword arguments (the key names of its config.json),
#: from the GLM-4.5-Air config.json on the Hub as published (https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/
#: config.json): hidden 4096, 46 layers, 96 query / 8 key-value heads of 128 (the attention width 12288 is not the
#: hidden size), 128 routed experts of intermediate 1408 plus 1 shared expert, top-8, ``n_group`` 1, ``topk_group``
#: 1, ``routed_scaling_factor`` 1.0, renormalized, the first layer dense (``first_k_dense_replace`` 1, intermediate
#: 10944), q / k / v bias, no q / k norms, rope_theta 1e6 over half of each head (`glm_45_air_rope`). The vocabulary,
#: the norm epsilon and the positions are ``Glm4MoeConfig``'s defaults (151552, 1e-5, 131072: the config class is
#: written for this family), not re-read from the Hub here (no network where this was written). Its MTP layer
#: (``num_nextn_predict_layers`` 1) is not part of transformers' model.
GLM_45_AIR = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1,
    num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
    first_k_dense_replace=1, attention_bias=True, use_qk_norm=False, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu")


def glm_45_air_rope() -> dict:
    """GLM-4.5-Air's ``rope_parameters``: default rope, ``rope_theta`` 1e6, ``partial_rotary_factor`` 0.5 (the first
    64 of each head's 128 features rotated; transformers 5.17 and 5.24 read the factor from this dict)."""
    return {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}
