"""`main.py chat`: the engine in a terminal, as text or as one JSON object per step."""

from __future__ import annotations

import json
import sys

from engine.chat import PromptTooLong
from engine.config import ConfigError, EngineConfig, SamplingParams, SpeculativeConfig
from engine.events import DoneEvent, StepEvent, TrimEvent
from engine.kv.base import KVCacheFull
from engine.loader import ModelLoadError


def step_record(ev: StepEvent) -> dict:
    record = {
        "phase": ev.phase, "pos": ev.pos, "n_tokens": ev.n_tokens, "latency_ms": round(ev.latency_ms, 3),
        "kv_bytes_allocated": ev.kv.bytes_allocated, "kv_bytes_used": ev.kv.bytes_used,
        "kv_bytes_theoretical": ev.kv.bytes_theoretical, "prefix_hit_tokens": ev.prefix_hit_tokens,
        "token_id": ev.token_id, "text": ev.text, "strategy": ev.strategy,
        "n_drafted": ev.n_drafted, "n_accepted": ev.n_accepted,
    }
    if ev.kv.num_blocks:
        record.update(blocks_used=ev.kv.num_blocks_used, blocks_free=ev.kv.num_blocks_free,
                      blocks_cached=ev.kv.num_blocks_cached)
    return record


def done_record(ev: DoneEvent) -> dict:
    return {
        "event": "done", "text": ev.text, "n_prompt_tokens": ev.n_prompt_tokens,
        "n_generated_tokens": ev.n_generated_tokens, "ttft_ms": round(ev.ttft_ms, 3),
        "decode_tok_s": round(ev.decode_tok_s, 3), "finish_reason": ev.finish_reason,
        "prefix_hit_tokens": ev.prefix_hit_tokens,
        "n_decode_steps": ev.n_decode_steps, "n_drafted": ev.n_drafted, "n_accepted": ev.n_accepted,
    }


def _print_event(ev, as_json: bool) -> None:
    if as_json:
        if isinstance(ev, StepEvent):
            print(json.dumps(step_record(ev)), flush=True)
        elif isinstance(ev, DoneEvent):
            print(json.dumps(done_record(ev)), flush=True)
        else:
            print(json.dumps({"event": "trim", "dropped_messages": ev.dropped_messages}), flush=True)
        return
    if isinstance(ev, StepEvent):
        print(ev.text, end="", flush=True)
    elif isinstance(ev, TrimEvent):
        print(f"[context full: dropped the {ev.dropped_messages} oldest messages]", file=sys.stderr)
    else:
        print(flush=True)
        speculation = (f"{ev.tokens_per_step:.2f} tokens/step, {ev.acceptance_rate:.0%} of drafts accepted, "
                       if ev.n_drafted else "")
        print(f"[{ev.n_generated_tokens} tokens, first after {ev.ttft_ms:.0f} ms, "
              f"{ev.decode_tok_s:.1f} tok/s, {speculation}{ev.finish_reason}]", file=sys.stderr)


def _messages(args):
    if args.prompt is not None:
        yield args.prompt
        return
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line.strip():
            yield line


def run_chat(args, engine=None) -> int:
    """engine: one already loaded (tests share one); --model and the cache options then do not apply."""
    from engine.engine import Engine

    try:
        config = EngineConfig(cache=args.cache, block_size=args.block_size or 16,
                              weights=getattr(args, "weights", None) or "auto",
                              prefix_reuse=getattr(args, "prefix_reuse", None) != "off",
                              kv_budget_mib=getattr(args, "kv_budget", None),
                              kv_dtype=getattr(args, "kv_dtype", None),
                              cuda_graphs=getattr(args, "cuda_graphs", None) != "off")
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                repetition_penalty=args.repetition_penalty,
                                max_new_tokens=args.max_new_tokens, seed=args.seed,
                                speculative=SpeculativeConfig(getattr(args, "speculative", "off"),
                                                              getattr(args, "draft_tokens", 8)))
        progress = None if args.json else (lambda msg, frac: print(f"[{msg}]", file=sys.stderr))
        engine = engine or Engine.load(args.model, config, progress)
    except (ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    conv = engine.new_conversation(args.system)
    status = 0
    try:
        for message in _messages(args):
            try:
                for ev in engine.generate(conv, message, params):
                    _print_event(ev, args.json)
            except (PromptTooLong, KVCacheFull, ValueError) as e:  # the conversation is unchanged: go on
                print(f"error: {e}", file=sys.stderr)
                status = 1
    except KeyboardInterrupt:
        return 130
    return status
