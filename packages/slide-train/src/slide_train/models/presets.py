"""Built-in model shapes: random-initialized from a transformers config, so nothing is downloaded.

`tiny-*` are for the quick start and tests (byte-level tokenizer). The public shapes (`llama-3.2-1b`, ...) are for
benchmarks and plans; their dimensions are the published configs' dimensions (Gemma, Phi-3 and OLMo 2 included;
the mixtures of experts OLMoE-1B-7B and Qwen3-30B-A3B with every expert: 6.9B and 30.5B parameters). `-256k`
shapes are the same widths with a 262,144-position limit and Llama 3.1's rope scaling, for sequences beyond 128k.
"""

from __future__ import annotations

import transformers

_TINY = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)

PRESETS: dict[str, dict] = {
    "tiny-llama": dict(model_type="llama", **_TINY),
    "tiny-qwen2": dict(model_type="qwen2", tie_word_embeddings=True, **_TINY),
    "tiny-qwen3": dict(model_type="qwen3", head_dim=32, **_TINY),
    "tiny-mistral": dict(model_type="mistral", sliding_window=None, **_TINY),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                          max_position_embeddings=131072, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "mistral-large-2": dict(model_type="mistral", hidden_size=12288, intermediate_size=28672, num_hidden_layers=88,
                            num_attention_heads=96, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                            rope_theta=1000000.0, max_position_embeddings=131072, sliding_window=None,
                            tie_word_embeddings=False, rms_norm_eps=1e-5),
    "phi-3-mini-4k": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, rope_theta=10000.0,
                          max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=2047,
                          pad_token_id=32000, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "olmo-2-7b": dict(model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=100352, rope_theta=500000.0,
                      max_position_embeddings=4096, pad_token_id=100277, tie_word_embeddings=False,
                      rms_norm_eps=1e-6),
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                       rope_theta=10000.0, max_position_embeddings=8192, sliding_window=4096,
                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                       rope_theta=10000.0, max_position_embeddings=8192, sliding_window=4096,
                       query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                       rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=32768,
                       sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    "gemma-3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262208,
                        rope_theta=1000000.0, rope_local_base_freq=10000.0, max_position_embeddings=131072,
                        sliding_window=1024, sliding_window_pattern=6, query_pre_attn_scalar=256,
                        tie_word_embeddings=True, rms_norm_eps=1e-6),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        norm_topk_prob=False, vocab_size=50304, rope_theta=10000.0, max_position_embeddings=4096,
                        pad_token_id=1, eos_token_id=50279, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                          rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                          rms_norm_eps=1e-6),
}



def _positions(base: str, positions: int, factor: float) -> dict:
    """`base`'s shape with a limit of `positions` and the rope scaling Llama 3.1 defines (rope_type llama3): long
    wavelengths stretched by `factor`, short ones kept, a smooth ramp between, about its 8,192-position original."""
    spec = dict(PRESETS[base])
    theta = spec.pop("rope_theta")
    return dict(spec, max_position_embeddings=positions,
                rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


# (each with its own release's factor: 8 for Llama 3.1, 32 for Llama 3.2)
PRESETS["llama-3.1-8b-256k"] = _positions("llama-3.1-8b", 262144, 8.0)
PRESETS["llama-3.2-3b-256k"] = _positions("llama-3.2-3b", 262144, 32.0)


def preset_config(name: str, vocab_size: int | None = None) -> transformers.PretrainedConfig:
    spec = dict(PRESETS[name])
    model_type = spec.pop("model_type")
    if vocab_size is not None and "vocab_size" not in spec:
        spec["vocab_size"] = vocab_size
    return transformers.AutoConfig.for_model(model_type, **spec)
