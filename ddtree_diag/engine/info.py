"""What an engine loaded, as (field, value) rows for ``engine-info`` and the server's banner."""

from __future__ import annotations

from typing import Any


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return str(num_bytes)


def _decode_path(info: dict[str, Any]) -> str:
    path = str(info.get("decode_path"))
    if path.startswith("fast"):
        path += ", fused Triton kernels" if info.get("fused_kernels") else ", torch ops (no fused kernels)"
    return path


def engine_info_rows(info: dict[str, Any]) -> list[tuple[str, str]]:
    draft = info.get("draft") or {}
    memory = info.get("memory") or {}
    rows = [
        ("model", str(info.get("model"))),
        ("target", str(info.get("target_path"))),
        ("model type", str(info.get("model_type"))),
        ("target layers", str(info.get("layers"))),
        ("hidden size", str(info.get("hidden_size"))),
        ("vocabulary", str(info.get("vocab_size"))),
        ("context length", str(info.get("context_length"))),
        ("device", str(info.get("device"))),
        ("dtype", str(info.get("dtype"))),
        *([("quantization", str(info["quantization"]))] if info.get("quantization") else []),
        ("stop token ids", ", ".join(map(str, info.get("stop_token_ids") or [])) or "—"),
        ("chat template", "yes" if info.get("chat_template") else "no (plain transcript)"),
        ("draft", str(info.get("draft_path")) if draft else "none (AR only)"),
    ]
    if draft:
        rows += [
            ("draft layers", str(draft.get("layers"))),
            ("target layer ids", ", ".join(map(str, draft.get("target_layer_ids", [])))),
            ("mask token id", str(draft.get("mask_token_id"))),
            ("block size", str(draft.get("block_size"))),
            ("draft heads", f"{draft.get('heads')} q / {draft.get('kv_heads')} kv × {draft.get('head_dim')}"),
        ]
    sliding = info.get("sliding_window")
    if sliding:
        tokens = " / ".join(map(str, sliding["tokens"]))
        count = len(sliding["layers"])
        rows.append(("sliding window", f"{tokens} tokens on {count} of {info.get('layers')} layers"))
    experts = info.get("experts")
    if experts:
        per_token = f", {experts['per_token']} a token" if experts.get("per_token") else ""
        rows.append(("mixture of experts", f"{experts['count']} experts{per_token} (the MLP runs as HF's module)"))
    latent = info.get("latent_attention")
    if latent:
        rows.append(("latent attention", f"latent {latent['kv_lora_rank']}; per head q/k {latent['qk_head_dim']} "
                                         f"({latent['qk_rope_head_dim']} rotary), v {latent['v_head_dim']}"))
    if info.get("attention_sinks"):
        rows.append(("attention sinks", "one logit a head on every attention layer"))
    hybrid = info.get("hybrid")
    if hybrid:
        states = hybrid.get("tree_state_bytes") or {}
        rows += [
            ("layer pattern", f"{hybrid['layer_pattern']} (L: Gated DeltaNet, A: full attention)"),
            ("tree state (scan)", ", ".join(f"budget {b}: {_size(v)}" for b, v in states.items())),
        ]
    rows += [
        ("default tree budget", str(info.get("default_tree_budget"))),
        ("decode path", _decode_path(info)),
        *([("GEMM library", str(info["gemm_library"]))] if info.get("gemm_library") else []),
        ("target weights", _size(memory.get("target_weights_bytes"))),
        ("draft weights", _size(memory.get("draft_weights_bytes"))),
    ]
    if "cuda_allocated_bytes" in memory:
        rows.append(("cuda allocated", _size(memory.get("cuda_allocated_bytes"))))
    return rows


def split_rows(plan: dict[str, Any]) -> list[tuple[str, str]]:
    """``engine-info --devices N``: the planned tensor-parallel split (``parallel.split_plan``)."""
    shards = plan["plan"]
    n = plan["devices"]
    heads = f"{shards['heads']} q / {shards['kv_heads']} kv attention heads, {shards['intermediate']} MLP channels"
    if shards.get("linear_v_heads"):
        heads += f", {shards['linear_k_heads']} k / {shards['linear_v_heads']} v Gated DeltaNet heads"
    tokens = plan["assumed_tokens"]
    kv = (plan["kv_cache_bytes_per_token_per_device"] + plan["draft_kv_cache_bytes_per_token"]) * tokens
    return [
        ("model", str(plan.get("model"))),
        ("devices", f"{n} × {plan['device_type']} ({plan['backend']}, one process per device)"),
        ("split", "tensor parallel: every device runs all "
                  f"{shards['layers']} layers on its share of the heads (eager decode path only)"),
        ("per device", heads),
        ("replicated", "embeddings, lm_head, norms, draft"),
        ("dtype", str(plan["dtype"])),
        ("target weights", f"{_size(plan['target_weights_bytes'])} in all"),
        ("weights per device", f"{_size(plan['sharded_weights_bytes_per_device'])} split + "
                               f"{_size(plan['replicated_weights_bytes'])} replicated + "
                               f"{_size(plan['draft_weights_bytes'])} draft"),
        (f"KV per device ({tokens} tokens)", _size(kv)),
        ("tree state per device", f"{_size(plan['tree_state_bytes_per_device'])} "
                                  f"(budget {plan['assumed_tree_budget']})"),
        ("estimated per device", _size(plan["estimated_bytes_per_device"])),
        ("device memory", _size(plan.get("device_memory_bytes")) + " each"),
        ("fits", "yes (estimate; not loaded)"),
    ]
