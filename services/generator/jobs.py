"""The generate job: the target's replies to a batch of prompts, one JSON file per sample.

Each sample ends in exactly one of: a reply file plus its queued extraction, a dropped reply
(``ReplyTooShort``), or a named failure. One sample's trouble never costs the others their replies.
A sample is a prompt's own reply or, with ``generation.replies`` > 1, one of its sampled replies
(``RunSpec.reply_of``): every turn it writes is asked at ``reply_temperature`` with the sample's own seed,
and its file records what it samples (``sampled``).
A reply is saved (atomically) as it arrives; the job's saved replies are marked generated together and
queued for extraction together when the job ends, in jobs of ``extract_batch`` samples, so one round trip
and one extract job's fork and bookkeeping serve many samples. A job killed before its end leaves its
saved replies on the volume; run again, it finds them and marks them without asking the server again.

A job whose worker is told to stop while some of its samples only wait (``runtime.shutdown``) lets the samples
that are working finish, marks and queues every saved reply as at its end, and raises ``JobYielded``: the worker
puts the job back on its queue, and the job run again asks only for the samples without a reply. A yield is
never a sample's failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import redis

from services.generator.client import (
    RETRY_DELAYS_S,
    ChatClient,
    Completion,
    MalformedCompletion,
    chat_payload,
)
from shared.conversation_turns import turn_segments
from shared import SCHEMA_VERSION
from shared.atomic import atomic_write_json
from runtime import shutdown
from runtime.disk import StageHold
from runtime.space import write_with_space
from shared.chat_turns import assistant_message
from shared.errors import (
    InferenceRejected,
    InferenceUnavailable,
    PromptTooLong,
    ReplyTooShort,
    error_class,
)
from shared.jobs import GenerateJob, PromptItem
from runtime.queues import job_connection
from runtime.retry import RetryPolicy
from shared.runspec import GenerationConfig, RunSpec, cached_spec
from runtime.runstate import GENERATE_REQUESTS, RunState
from shared.lifecycle import Failure, FailureKind, SampleResult, Stage
from runtime.sample_queue import enqueue_extract
from shared.settings import GeneratorSettings, load_settings

log = logging.getLogger(__name__)

EXPECTED_ERRORS = (InferenceRejected, InferenceUnavailable, MalformedCompletion, PromptTooLong, ReplyTooShort)


@lru_cache(maxsize=1)
def worker_settings() -> GeneratorSettings:
    return load_settings(GeneratorSettings)


def generate(payload: dict) -> dict:
    """RQ entry point (``shared.jobs.GENERATE_FUNC``)."""
    job = GenerateJob.model_validate(payload)
    settings = worker_settings()
    return run_generate(job, settings, job_connection(settings.redis_url))


def run_generate(job: GenerateJob, settings: GeneratorSettings, conn: redis.Redis, *,
                 retry_delays_s: Sequence[float] = RETRY_DELAYS_S) -> dict:
    """Generate every sample of ``job``; returns how many ended done, skipped, dropped or failed."""
    spec = cached_spec(settings.data, job.run)
    state = RunState(conn, settings.data, job.run)
    results = asyncio.run(_generate_all(job, spec, state, settings, retry_delays_s))
    settled = {item.sample_id: r for item, r in zip(job.items, results) if not isinstance(r, shutdown.JobYielded)}
    summary = settle(state, spec, settings, settled)
    first = job.items[0].sample_id
    if len(settled) < len(job.items):
        log.info("run %s: generate batch from %d gives %d of its %d samples back unsettled; settled: %s", job.run,
                 first, len(job.items) - len(settled), len(job.items), summary or "none")
        raise next(r for r in results if isinstance(r, shutdown.JobYielded))
    log.info("run %s: generate batch from %d: %s", job.run, first, summary)
    return summary


def settle(state: RunState, spec: RunSpec, settings: GeneratorSettings,
           settled: dict[int, tuple[SampleResult, int, int]]) -> dict[str, int]:
    """Mark the saved replies among ``settled`` (sample id -> ``_one``'s result) generated and queue their
    extraction; how many samples ended done, skipped, dropped or failed."""
    replies = [i for i, (outcome, _, _) in settled.items() if outcome in (SampleResult.DONE, SampleResult.SKIPPED)]
    sizes = {i: nbytes for i, (_, nbytes, _) in settled.items()}
    mark_generated(state, replies, sizes, sum(asked for _, _, asked in settled.values()))
    if not spec.online.enabled:  # an online run's trainer asks for each sample's states when it needs them
        queue_extractions(state, replies, settings)
    return {result.value: count for result, count in Counter(outcome for outcome, _, _ in settled.values()).items()}


async def _generate_all(job: GenerateJob, spec: RunSpec, state: RunState, settings: GeneratorSettings,
                        retry_delays_s: Sequence[float]) -> list[tuple[SampleResult, int, int] | shutdown.JobYielded]:
    """Each sample's ``_one``, or the ``JobYielded`` it raised. Every sample runs to its end before the client
    closes, so a stop request never cuts a working sample short (its reply would be lost, or failed)."""
    limit = asyncio.Semaphore(settings.concurrency)
    # Fixed delays are a test's choice; otherwise the environment's retry policy applies.
    policy = RetryPolicy.from_settings(settings) if retry_delays_s is None else None
    # Starting at the batch's first sample id spreads batches over the endpoints from their first request.
    async with ChatClient(settings.inference_url, timeout_s=settings.request_timeout_s,
                          max_connections=settings.concurrency, retry_delays_s=retry_delays_s,
                          policy=policy, start=job.items[0].sample_id) as client:
        results = await asyncio.gather(*(_one(item, spec, state, client, limit) for item in job.items),
                                       return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, shutdown.JobYielded):
            raise result  # Redis away, or a cancellation: the job fails (or stops) as before
    return results


async def _one(item: PromptItem, spec: RunSpec, state: RunState, client: ChatClient,
               limit: asyncio.Semaphore) -> tuple[SampleResult, int, int]:
    """The sample's outcome, the bytes of its reply file and the requests its turns took (each
    counted once, retries apart); a saved reply is marked with the job's."""
    sample_id = item.sample_id
    if state.paths.generated(sample_id).is_file():  # saved by a job killed before marking it: counted now
        return SampleResult.SKIPPED, state.paths.generated(sample_id).stat().st_size, 0
    segments = turn_segments(item.messages, spec.generation.turns)[: spec.generation.max_turns]
    generation = spec.generation.for_reply(spec.reply_of(sample_id)[1])  # a sampled reply samples every turn
    conversation: list[dict] = []
    turns: list[Turn] = []
    try:
        for segment in segments:
            conversation += segment
            completion = await _ask(client, limit, state, spec, generation, conversation, sample_id)
            check_length(completion, spec.generation)
            turns.append(Turn(list(conversation), completion))
            conversation.append(assistant_message(completion.content, completion.reasoning_content))
    except redis.RedisError:
        raise  # Redis away is no fault of the sample: the job fails and runs again once Redis is back
    except shutdown.JobYielded:
        raise  # the worker is stopping: the sample goes back to the queue unsettled, never failed
    except Exception as exc:  # noqa: BLE001 - the per-sample boundary: a bug here must not cost the batch
        if not isinstance(exc, EXPECTED_ERRORS):
            log.exception("run %s: sample %d: unexpected error", state.run, sample_id)
        asked = len(turns) + 1  # the turn that failed asked too
        where = failure_place(spec, sample_id, asked, len(segments))
        return await asyncio.to_thread(record_failure, state, sample_id, exc, where), 0, asked
    record = reply_record(item, turns, sampled_from(spec, sample_id))
    return SampleResult.DONE, await asyncio.to_thread(save_reply, state, item.sample_id, record), len(turns)


async def _ask(client: ChatClient, limit: asyncio.Semaphore, state: RunState, spec: RunSpec,
               generation: GenerationConfig, conversation: list[dict], sample_id: int) -> Completion:
    """One turn's reply, asked as ``generation`` says (the run's settings for the sample's reply). Every turn of a
    sample asks with the sample's seed, so a rerun asks the same."""
    async with limit:
        return await client.complete(
            chat_payload(spec.model, conversation, generation, spec.generation.seed + sample_id),
            on_retry=lambda: state.note_retry(Stage.GENERATE))


def failure_place(spec: RunSpec, sample_id: int, turn: int, turns: int) -> str:
    """Where in its sample a failure happened: which sampled reply of which row (none for a row's own reply) and,
    in a conversation of several turns, which turn."""
    label = spec.generation.reply_label(*spec.reply_of(sample_id))
    return label + ("" if turns == 1 else f"turn {turn} of {turns}: ")


def sampled_from(spec: RunSpec, sample_id: int) -> dict | None:
    """What a sampled reply's file records of its making: the row it answers, which of its replies it is and how it
    was sampled (its sample id alone does not say); None for a row's own reply, recorded as with one reply."""
    row, reply = spec.reply_of(sample_id)
    if reply == 0:
        return None
    generation = spec.generation
    return {"row": row, "reply": reply, "temperature": generation.reply_temperature, "top_p": generation.reply_top_p,
            "seed": generation.seed + sample_id}


@dataclass(frozen=True)
class Turn:
    """One regenerated turn: the messages the target answered, and its answer."""

    messages: list[dict]
    completion: Completion


def check_length(completion: Completion, generation: GenerationConfig) -> None:
    tokens = completion.completion_tokens
    if tokens is not None and tokens < generation.min_completion_tokens:
        raise ReplyTooShort(
            f"reply has {tokens} tokens, fewer than min_completion_tokens={generation.min_completion_tokens}"
        )


def record_failure(state: RunState, sample_id: int, exc: BaseException, where: str = "") -> SampleResult:
    """Name the sample's failure; ``where`` says which turn of a conversation it happened in."""
    kind = FailureKind.DROPPED if isinstance(exc, ReplyTooShort) else FailureKind.ERROR
    message = f"{where}{exc}"
    state.mark_failed(Failure(run=state.run, stage=Stage.GENERATE, sample_id=sample_id,
                              error_class=error_class(exc), message=message, kind=kind))
    log.warning("run %s: sample %d %s: %s: %s", state.run, sample_id, kind, error_class(exc), message)
    return kind.result


def turn_record(completion: Completion) -> dict:
    """What the target answered in one turn: its reply, usage, why it stopped, the engine's own ids."""
    record = {
        "reply": {"content": completion.content, "reasoning_content": completion.reasoning_content},
        "usage": completion.usage,
        "finish_reason": completion.finish_reason,
    }
    if completion.prompt_token_ids is not None and completion.token_ids is not None:
        record["token_ids"] = {"prompt": completion.prompt_token_ids, "reply": completion.token_ids}
    return record


def reply_record(item: PromptItem, turns: list[Turn], sampled: dict | None = None) -> dict:
    """The sample's file: the last turn's prompt and reply at the top (what extraction of a single turn
    reads), and, for a conversation of several regenerated turns, each turn's messages and answer; a sampled
    reply's also says what it samples (``sampled_from``)."""
    last = turns[-1]
    record = {
        "schema_version": SCHEMA_VERSION,
        "sample_id": item.sample_id,
        "messages": last.messages,
        **turn_record(last.completion),
        "model": last.completion.model,
    }
    if len(turns) > 1:
        record["turns"] = [{"messages": turn.messages, **turn_record(turn.completion)} for turn in turns]
    if sampled is not None:
        record["sampled"] = sampled
    return record


def save_reply(state: RunState, sample_id: int, record: dict) -> int:
    """Write the sample's reply file atomically; its size in bytes. A full volume makes it wait for space (the
    reply cost the target's time: it is kept, not failed), with the generate stage held in the run's status."""
    path = state.paths.generated(sample_id)
    write_with_space(lambda: atomic_write_json(path, record), f"the reply of sample {sample_id}",
                     state.paths.data, hold=StageHold(state.conn, state.run, Stage.GENERATE))
    return path.stat().st_size


def mark_generated(state: RunState, sample_ids: list[int], sizes: dict[int, int], requests: int = 0) -> None:
    """Mark the job's saved replies generated with their file sizes (``sizes``, bytes by sample id: counted in
    the same atomic step, for the samples not generated before), then count the requests the job's samples
    took: two round trips for the whole job."""
    state.mark_done_many(Stage.GENERATE, sample_ids, landed={i: {"generated_bytes": sizes.get(i, 0)} for i in sample_ids})
    state.incr_many({GENERATE_REQUESTS: requests})


def queue_extractions(state: RunState, sample_ids: list[int], settings: GeneratorSettings) -> list[list[int]]:
    """Make sure the extraction of every reply in ``sample_ids`` not yet extracted is queued (idempotent);
    returns the batches queued now."""
    open_ids = [sample_id for sample_id in sample_ids if not state.is_done(Stage.EXTRACT, sample_id)]
    return enqueue_extract(state.conn, state.run, open_ids, batch=settings.extract_batch,
                           result_ttl=settings.sample_result_ttl_s)
