"""Build a tiny random-weight model SGLang can serve: `python make_tiny.py {hybrid|dense} OUT [VOCAB]`.

Runs with the SGLang python (it needs torch and transformers, which SGLang brings). Random weights:
latencies are real GPU work, outputs are noise. The vocab defaults to 32768 so the canary's ordinary
token ids are valid.

hybrid: Qwen3-Next shape (GDN/Mamba linear-attention layers plus one full-attention layer in four,
MoE), the model the HiCache field reports are about. dense: a plain Qwen3 of the same width.
"""

import json
import sys

import torch


def hybrid(vocab: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=65536, full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    # SGLang 0.5.17's own Qwen3NextConfig derives layer kinds from full_attention_interval and reads
    # rope_theta/partial_rotary_factor at the top level, where transformers 5 no longer writes them.
    extra = {"full_attention_interval": 4, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    return Qwen3NextForCausalLM(cfg), extra


def dense(vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return Qwen3ForCausalLM(cfg), {"rope_theta": 10000.0}


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]
    vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
    torch.manual_seed(0)
    model, extra = {"hybrid": hybrid, "dense": dense}[kind](vocab)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    path = f"{out}/config.json"
    with open(path) as f:
        c = json.load(f)
    for k, v in extra.items():
        c.setdefault(k, v)
    c["torch_dtype"] = "bfloat16"
    with open(path, "w") as f:
        json.dump(c, f, indent=2)
    print(kind, "layer_types", c.get("layer_types"), "params", sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    main()
