"""The Compare job, run by the worker on its thread like a generation: replay the conversation's exact tokens
under each chosen configuration (engine.replay), reporting every step, the progress, and the result at the end.

Stop ends it within a step: the configurations replayed so far, and the one under way marked incomplete, are the
result. A configuration that cannot run (weights that do not load, a cache too small) is kept with its error and
the next one runs. The live conversation's cache is untouched (engine.replay sets it aside).
Replay under other weights needs the model in them: loaded again from its file when it came from one, or
converted from a copy of the weights in memory (an engine built in code, as in tests).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from engine.replay import ReplayConfig, ReplayError, check_turns, conversation_turns, replay, with_engine_weights
from engine.replay_result import CompareResult, ConfigRun, StepRow


@dataclass(frozen=True)
class CompareStep:
    """One replayed step, as the Compare view draws it: which configuration (index) and the row."""

    config_index: int
    row: StepRow


@dataclass(frozen=True)
class CompareJob:
    """What the worker hands the job: its signals, engine and conversation, and how to check for Stop, where the
    model came from (None: the default model) and how to report a load's progress."""

    signals: object
    engine: object
    conv: object
    cancelled: object  # () -> bool
    model_path: str | None = None
    progress: object = None  # (message, fraction | None) -> None


def run_compare(job: CompareJob, configs: list[ReplayConfig]) -> None:
    """Always ends with compare_done: the result, or an empty one whose error says why nothing ran."""
    try:
        job.signals.compare_done.emit(_replay_all(job, configs))
    except Exception as e:  # noqa: BLE001 - the window waits for compare_done: it always comes
        job.signals.compare_done.emit(CompareResult(error=str(e) or type(e).__name__))


def _replay_all(job: CompareJob, configs: list[ReplayConfig]) -> CompareResult:
    signals, engine, cancelled = job.signals, job.engine, job.cancelled
    if engine is None:
        return CompareResult(error="no model is loaded yet: wait for loading to finish, then Compare")
    turns = conversation_turns(engine.tokenizer, job.conv)
    try:
        check_turns(turns, engine.max_context)
    except ReplayError as e:
        return CompareResult(error=str(e))
    result = CompareResult([], len(turns))
    total = len(configs) * sum(len(t.reply) + 1 for t in turns)
    others: dict[str, object] = {}  # engines loaded in other weights for this job only
    for index, config in enumerate(configs):
        if cancelled():
            break
        named = with_engine_weights(config, engine)
        run = ConfigRun(named)
        result.runs.append(run)
        signals.progress.emit(f"Compare: replaying under {named.label} ({index + 1} of {len(configs)})…",
                              len(result.runs[:-1]) / max(len(configs), 1))
        try:
            target = _engine_with_weights(job, named.weights, others)
            for step in replay(target, turns, replace(named, kv_dtype=config.kv_dtype), cancelled):
                row = StepRow.from_step(step)
                run.rows.append(row)
                signals.compare_step.emit(CompareStep(index, row))
                done = sum(len(r.rows) for r in result.runs)
                if done % 16 == 0:
                    signals.progress.emit(f"Compare: replaying under {named.label} ({index + 1} of "
                                          f"{len(configs)})…", min(done / total, 1.0))
            run.complete = not cancelled()
        except Exception as e:  # noqa: BLE001 - kept with the configuration; the next one runs
            run.error = str(e)
    others.clear()
    return result


def _engine_with_weights(job: CompareJob, weights: str, others: dict):
    if weights == job.engine.weight_format:
        return job.engine
    if weights not in others:
        others[weights] = _load_in(job, weights)
    return others[weights]


def _load_in(job: CompareJob, weights: str):
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = job.engine
    config = EngineConfig(**{**engine.config.__dict__, "weights": weights})
    if job.model_path is not None or engine.weights_file_bytes:
        return Engine.load(job.model_path, config, progress=job.progress)
    return Engine(copy_of_model(engine.model), engine.tokenizer, config, engine.model_name)


def copy_of_model(model):
    """A deep copy of the weights in memory; the compiled kernels' op namespaces (which cannot be copied) are
    shared, not copied."""
    shared = {id(value): value for module in model.modules() for value in vars(module).values()
              if type(value).__name__ == "_OpNamespace"}
    return copy.deepcopy(model, shared)
