"""`/server_info` and `/model_info` bodies: the real 0.5.23 key set, overridden by resolved args.

SGLang returns `{**asdict(server_args), **scheduler_info, "internal_states": [...], "version": ...}`.
The template (templates/server_info.py) is the fixture's write_back seed; the simulator overrides
every field its own flags decide. Secrets: SGLang 0.5.23 already shows secret-like fields as
"<redacted>" (watermark keys in the fixture); a set api key is reported the same way, never echoed.
"""

from __future__ import annotations

import copy

from .config import SimConfig
from .templates.server_info import SERVER_INFO

REDACTED = "<redacted>"


def server_info(cfg: SimConfig, last_gen_throughput: float = 0.0) -> dict:
    args = copy.deepcopy(SERVER_INFO["top"])
    args.pop("version", None)
    overrides = {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "served_model_name": cfg.served_model_name,
        "host": cfg.host,
        "port": cfg.port,
        "tp_size": cfg.tp_size,
        "dp_size": cfg.dp_size,
        "page_size": cfg.page_size,
        "max_total_tokens": cfg.max_total_tokens,
        "context_length": cfg.context_length,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_running_requests": cfg.max_running_requests,
        "enable_hierarchical_cache": cfg.enable_hierarchical_cache,
        "hicache_write_policy": cfg.hicache_write_policy,
        "hicache_ratio": cfg.hicache_ratio,
        "hicache_size": cfg.hicache_size,
        "enable_metrics": cfg.enable_metrics,
        "enable_cache_report": cfg.enable_cache_report,
        "api_key": REDACTED if cfg.api_key else None,
        "admin_api_key": None,
        "speculative_algorithm": cfg.speculative_algorithm,
        "uses_mamba_radix_cache": cfg.hybrid_model,
        "mamba_radix_cache_strategy": "extra_buffer" if cfg.hybrid_model else None,
        "max_mamba_cache_size": cfg.max_mamba_cache_size if cfg.hybrid_model else None,
        "random_seed": cfg.seed,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_req_input_len": cfg.max_req_input_len,
    }
    if cfg.speculative_algorithm is None:
        overrides["speculative_draft_model_path"] = None
        overrides["speculative_num_draft_tokens"] = None
    args.update({k: v for k, v in overrides.items() if k in args or k in ("max_total_num_tokens", "max_req_input_len")})
    internal = {k: v for k, v in args.items() if k not in ("max_total_num_tokens", "max_req_input_len")}
    extra = copy.deepcopy(SERVER_INFO["internal_extra"])
    extra["world_size"] = cfg.tp_size
    extra["effective_max_running_requests_per_dp"] = cfg.max_running_requests
    extra["last_gen_throughput"] = last_gen_throughput
    if isinstance(extra.get("memory_usage"), dict):
        extra["memory_usage"]["token_capacity"] = cfg.max_total_tokens
    internal.update(extra)
    return {**args, "internal_states": [internal], "version": cfg.metrics_profile}


def model_info(cfg: SimConfig) -> dict:
    hybrid = cfg.hybrid_model
    return {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "qwen3_next" if hybrid else "qwen3",
        "architectures": ["Qwen3NextForCausalLM" if hybrid else "Qwen3ForCausalLM"],
    }
