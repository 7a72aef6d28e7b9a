"""Every kind of parameter of a DeepSeek-V3 model with its full shape and the dim tensor parallelism splits it
along (parallelize.py's plan): the query / key-value up-projections and dense w1/w3 by output (0), the output
projection and dense w2 by input (1), the embedding and output head by vocabulary (0); the low-rank
down-projections, their norms, the MoE layers and every other norm replicated (None)."""

from __future__ import annotations

from titan_npu.models.deepseek_v3.args import DeepSeekArgs

TP_DIM = {"attention.wq.weight": 0, "attention.wq_b.weight": 0, "attention.wkv_b.weight": 0, "attention.wo.weight": 1,
          "feed_forward.w1.weight": 0, "feed_forward.w3.weight": 0, "feed_forward.w2.weight": 1,
          "tok_embeddings.weight": 0, "output.weight": 0}


def parameter_kinds(args: DeepSeekArgs) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Each kind of parameter -> (full shape, tensor-parallel dim), in the model's order (a kind names a parameter
    inside any block that has it: the dense SwiGLU's only if some layer is dense, the MoE's if some is MoE)."""
    d, h, qk = args.dim, args.n_heads, args.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if args.q_lora_rank:
        r = args.q_lora_rank
        shapes.update({"attention.wq_a.weight": (r, d), "attention.q_norm.weight": (r,),
                       "attention.wq_b.weight": (h * qk, r)})
    else:
        shapes["attention.wq.weight"] = (h * qk, d)
    kv = args.kv_lora_rank
    shapes.update({"attention.wkv_a.weight": (kv + args.qk_rope_head_dim, d), "attention.kv_norm.weight": (kv,),
                   "attention.wkv_b.weight": (h * (args.qk_nope_head_dim + args.v_head_dim), kv),
                   "attention.wo.weight": (d, h * args.v_head_dim)})
    if args.first_k_dense:
        f = args.ffn_dim
        shapes.update({"feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f),
                       "feed_forward.w3.weight": (f, d)})
    if args.n_moe_layers:
        e, f = args.n_experts, args.moe_ffn_dim
        shapes.update({"feed_forward.router.gate.weight": (e, d), "feed_forward.experts.w1": (e, f, d),
                       "feed_forward.experts.w2": (e, d, f), "feed_forward.experts.w3": (e, f, d)})
        if args.n_shared_experts:
            s = args.n_shared_experts * f
            shapes.update({"feed_forward.shared_experts.w1.weight": (s, d),
                           "feed_forward.shared_experts.w2.weight": (d, s),
                           "feed_forward.shared_experts.w3.weight": (s, d)})
    shapes.update({"attention_norm.weight": (d,), "ffn_norm.weight": (d,),
                   "tok_embeddings.weight": (args.vocab_size, d), "norm.weight": (d,)})
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return {kind: (shape, TP_DIM.get(kind)) for kind, shape in shapes.items()}
