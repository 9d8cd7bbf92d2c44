"""The figures beside the plots, as (title, value, detail) rows: pure functions of what the engine reported."""

from __future__ import annotations

from html import escape

from app.model_info import ModelInfo, kv_bytes, kv_outgrows_weights_at
from app.style import TEXT_MUTED, human_bytes, strategy_color

INT8_BYTES = 1


def figure_rows(info: ModelInfo | None, kv, last_done=None) -> list[tuple[str, str, str]]:
    """kv: the latest KVStats (or None); last_done: the last turn's DoneEvent (or None)."""
    if info is None:
        return [("Model", "loading…", "")]
    rows = [_bytes_per_token(info)] + ([_sliding(info)] if info.sliding_layers else [])
    rows += [_weights_vs_kv(info), _gqa(info)]
    rows.append(_precisions(info, kv) if info.precision_bytes else _int8(info))
    if kv is not None:
        rows += [_utilisation(kv), _memory_now(kv)]
        if getattr(kv, "bytes_window", 0):
            rows.append(_window(kv))
    rows.append(_prefix_hits(last_done))
    if getattr(last_done, "n_drafted", 0):
        rows.append(_speculation(last_done))
    return rows


def figures_html(rows: list[tuple[str, str, str]]) -> str:
    """Each figure as a muted title, a bold value and a small detail line: readable in a narrow column."""
    return "".join(
        f'<p style="margin:0 0 8px 0;"><span style="color:{TEXT_MUTED}; font-size:small;">{escape(title)}</span>'
        f'<br><b>{escape(value)}</b><br><span style="color:{TEXT_MUTED}; font-size:small;">'
        f'{escape(detail).replace(chr(10), "<br>")}</span></p>'
        for title, value, detail in rows
    )


def strategy_badge(strategy: str) -> str:
    return f'<span style="color:{strategy_color(strategy)};">■</span> {escape(strategy)}'


def _bytes_per_token(info: ModelInfo) -> tuple[str, str, str]:
    kv = kv_bytes(info)  # the same figures as Help → About
    if not kv.holds_kv:
        return ("KV bytes per token", "nothing held (none)",
                f"none keeps no keys or values; a cache would need {kv.formula} ({human_bytes(kv.bytes_per_token)})")
    stored = f", {info.kv_dtype_text}" if info.kv_dtype_text else ""
    return ("KV bytes per token", f"{human_bytes(kv.bytes_per_token)} / token ({kv.strategy}{stored})", kv.formula)


def _sliding(info: ModelInfo) -> tuple[str, str, str]:
    """What a sliding-window model's cache holds of those layers (Gemma 2/3)."""
    if not info.window_only:
        return ("Sliding-window layers", f"{info.sliding_layers} of {info.num_layers} slide", info.sliding_text)
    kv = kv_bytes(info)
    value = (f"{info.sliding_layers} of {info.num_layers} layers slide with window {info.sliding_window:,} "
             f"and hold only it")
    detail = (f"{info.sliding_text}: at most {human_bytes(kv.window_bytes_per_token * info.sliding_window)} a "
              f"sequence; the other {info.held_layers} layers hold every token "
              f"({human_bytes(kv.bytes_per_token)}/token)")
    return ("Sliding-window layers", value, detail)


def _precisions(info: ModelInfo, kv) -> tuple[str, str, str]:
    """What each KV precision would hold for this conversation, and where each would outgrow the weights."""
    tokens = kv.tokens if kv is not None else 0
    lines = []
    for name, per_token in info.precision_bytes:
        at = int(info.weights_bytes // per_token) + 1 if info.weights_bytes and per_token else None
        mark = "▸ " if name == info.kv_dtype else ""
        beyond = "—" if at is None else f"{at:,}" + ("" if at <= info.max_context else " (beyond the context)")
        lines.append(f"{mark}{name}: {human_bytes(per_token * tokens)} now · {human_bytes(per_token)}/token · "
                     f"outgrows the weights at {beyond}")
    window = kv_bytes(info).window_bytes_per_token * min(tokens, info.sliding_window)
    if window:
        lines.append(f"(the {info.held_layers} global layers; the sliding layers' window adds "
                     f"{human_bytes(window)} now, unquantized)")
    active = f"active: {info.kv_dtype_text}" if info.kv_dtype_text else "active: none (no cache kept)"
    return (f"Each KV precision for this conversation ({tokens:,} tokens)", active, "\n".join(lines))


def _window(kv) -> tuple[str, str, str]:
    """A quantized cache keeps its newest tokens in full precision until their block fills: its own line, so the
    figures add up to the allocated bytes the status bar shows."""
    return ("Full-precision window", human_bytes(kv.bytes_window),
            "the newest tokens of each sequence, kept unquantized until their block fills (counted in allocated)")


def _weights_vs_kv(info: ModelInfo) -> tuple[str, str, str]:
    """The article's point: past this context, the KV cache holds more bytes than the model's weights."""
    at = kv_outgrows_weights_at(info)
    weights = f"{info.weight_format} weights: {human_bytes(info.weights_bytes)}"
    if at is None:
        return ("KV cache vs weights", "no KV held (none)", f"{weights}; none keeps no keys or values")
    beyond = "" if at <= info.max_context else f" (beyond this model's {info.max_context:,}-token context)"
    return ("KV cache outgrows the weights at", f"{at:,} tokens{beyond}",
            f"{weights}; KV {human_bytes(kv_bytes(info).bytes_per_token)} per token ({info.cache_strategy})")


def _gqa(info: ModelInfo) -> tuple[str, str, str]:
    mha = 2 * info.dtype_bytes * info.num_layers * info.num_heads * info.head_dim
    value = f"{info.gqa_ratio:g}× smaller than multi-head"
    detail = (f"{info.num_heads} query heads share {info.num_kv_heads} KV heads; multi-head would need "
              f"{mha:,} bytes/token")
    return ("Grouped-query saving", value, detail)


def _int8(info: ModelInfo) -> tuple[str, str, str]:
    full, kv = info.dtype_bytes, kv_bytes(info)
    if kv.strategy == "paged-int8":
        return ("int8 compression", f"{full / kv.bytes_per_element:.2f}× smaller",
                f"{info.dtype_name}: {full} B/element → int8 with scales: {kv.bytes_per_element:.4g} B/element")
    return ("int8 compression", f"up to {full / INT8_BYTES:g}× with paged-int8",
            f"{info.dtype_name} stores {full} B/element; int8 stores {INT8_BYTES} B plus its scales")


def _utilisation(kv) -> tuple[str, str, str]:
    if not kv.bytes_allocated:
        return ("Pool utilisation", "nothing allocated", f"{kv.strategy} holds no KV storage now")
    share = kv.bytes_used / kv.bytes_allocated
    detail = f"{human_bytes(kv.bytes_used)} used of {human_bytes(kv.bytes_allocated)} allocated"
    if kv.num_blocks:
        detail += (f"; blocks: {kv.num_blocks_used} used, {kv.num_blocks_cached} cached, "
                   f"{kv.num_blocks_free} free of {kv.num_blocks}")
    return ("Pool utilisation", f"{share:.1%}", detail)


def _memory_now(kv) -> tuple[str, str, str]:
    if kv.strategy == "none":
        return ("KV memory now", "0 B: nothing held",
                f"none holds no tokens; every step recomputes the {kv.tokens:,}-token context "
                f"(a cache would hold {human_bytes(kv.bytes_theoretical)})")
    detail = (f"{kv.tokens:,} tokens held; theoretical {human_bytes(kv.bytes_theoretical)}, "
              f"used {human_bytes(kv.bytes_used)}")
    if kv.bytes_budget:  # a pool that grows: what it holds, what its blocks in use hold, and how far it may grow
        value = (f"{human_bytes(kv.bytes_allocated)} allocated / {human_bytes(kv.bytes_used)} used / "
                 f"{human_bytes(kv.bytes_budget)} budget")
        detail += (f"; the pool grows in chunks up to its budget ({kv.num_blocks:,} of {kv.num_blocks_budget:,} "
                   f"blocks exist)")
        return ("KV memory now", value, detail)
    return ("KV memory now", human_bytes(kv.bytes_allocated), detail)


def _prefix_hits(done) -> tuple[str, str, str]:
    if done is None:
        return ("Prefix cache, last turn", "–", "no turn yet")
    total = max(done.n_prompt_tokens, 1)
    value = f"{done.prefix_hit_tokens:,} of {done.n_prompt_tokens:,} prompt tokens reused"
    return ("Prefix cache, last turn", value, f"{done.prefix_hit_tokens / total:.0%} of the prompt was not recomputed")


def _speculation(done) -> tuple[str, str, str]:
    value = f"{done.acceptance_rate:.0%} of drafts accepted · {done.tokens_per_forward:.2f} tokens per forward"
    detail = (f"{done.n_accepted:,} of {done.n_drafted:,} draft tokens kept over {done.n_decode_steps:,} decode "
              f"steps ({done.n_decode_forwards:,} forwards); plain decoding makes 1 token per forward")
    return ("Speculative decoding, last reply", value, detail)
