"""The extract job: prompt + reply → token ids and loss mask → hidden-state file, verified before it counts.

The ids are the engine's own where the reply record carries them (``token_ids``, from servers that return
them), else the target's chat template renders the conversation (``shared/sample_tokens.py`` says how).

A sample counts as extracted only after ``verify_hidden_file`` accepts what the server wrote: shapes
match the tokens we sent, the layer ids are the run's, the states are stored as the run's
``extraction.storage`` says, every value is finite, and the checksum is the one the server reported.
The verified file is then recorded in its shard's ``manifest.jsonl`` (what a resume checks files
against) before the sample is marked done. The run's layer ids are fixed by its first verified sample,
so a server restarted with other defaults cannot mix layers within one run.

A job holds a batch of samples (``ExtractJob.sample_ids``), each settled on its own: a sample already
extracted is skipped, so a job run again after its work horse was killed redoes only the samples it had
not finished, and a sample that fails is named without costing the others of the batch. A sample that waits
(for disk space, for room in an online run's budget, for a server that is down) when the worker is told to stop
raises ``JobYielded`` through all of this: the job ends there, unfailed, and the worker puts it back on its queue
for the samples it had not settled (``runtime.shutdown``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import redis

from services.extractor.client import HiddenStatesResult, MalformedHiddenResponse
from services.extractor.sources import HiddenStateSource, make_source
from shared import eagle3
from shared.chat_turns import TurnEnd
from runtime import shutdown
from runtime.disk import landed_counts, wait_for_headroom
from runtime.disk_claims import BudgetDeferred, claim_space
from runtime.spool import ONLINE_EXTRACT_S, add_seconds, note_peak, release
from shared.errors import DraftlineError, HiddenStateFileError, error_class
from shared.hidden_file import HiddenFileInfo, verify_hidden_file
from shared.jobs import ExtractJob
from shared.manifest import ManifestEntry, append_entry, manifest_path
from runtime.queues import job_connection
from runtime.remote_code import load_from_target
from shared.runspec import RunSpec, cached_spec
from shared.sample_tokens import read_reply, sample_of, target_turn_end
from runtime.runstate import RunState
from shared.lifecycle import Failure, RunKeys, SampleResult, Stage
from shared.settings import ExtractorSettings, load_settings

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def worker_settings() -> ExtractorSettings:
    return load_settings(ExtractorSettings)


@lru_cache(maxsize=2)
def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    """The target's tokenizer, loaded once per process (the worker preloads it before forking); code the
    directory ships runs only with ``trust_remote_code`` (``runtime.remote_code``)."""
    from transformers import AutoTokenizer

    return load_from_target(AutoTokenizer.from_pretrained, model_dir, trust_remote_code=trust_remote_code)


@lru_cache(maxsize=2)
def turn_end_of(tokenizer, model_dir: str) -> TurnEnd:
    """The target's end-of-turn token, found once per tokenizer from its template and eos ids."""
    turn_end = target_turn_end(tokenizer, Path(model_dir))
    log.info("target %s: end of turn %r (from %s)", model_dir, turn_end.token(tokenizer), turn_end.source)
    return turn_end


def preload(model_dir: str, trust_remote_code: bool = False) -> None:
    """What the worker loads before forking, so each job's child inherits it."""
    turn_end_of(load_tokenizer(model_dir, trust_remote_code), model_dir)


def extract(payload: dict) -> dict:
    """RQ entry point (``shared.jobs.EXTRACT_FUNC``); returns how many samples ended done, skipped or failed."""
    job = ExtractJob.model_validate(payload)
    settings = worker_settings()
    # Starting at the first sample id sends consecutive samples to consecutive endpoints.
    source = make_source(settings, model=cached_spec(settings.data, job.run).model, start=job.sample_ids[0])
    try:
        tokenizer = load_tokenizer(str(settings.model_dir), settings.trust_remote_code)
        results = run_extract(job, settings, job_connection(settings.redis_url), tokenizer, source)
        summary = {result.value: count for result, count in Counter(results).items()}
    finally:
        source.close()
    log.info("run %s: extract batch from %d: %s", job.run, job.sample_ids[0], summary)
    return summary


def run_extract(job: ExtractJob, settings: ExtractorSettings, conn: redis.Redis, tokenizer,
                client: HiddenStateSource) -> list[SampleResult]:
    """Extract each sample of ``job`` in turn; returns what became of each (done, skipped or failed: failures
    are recorded, not raised)."""
    state = RunState(conn, settings.data, job.run)
    return [extract_one(state, sample_id, settings, tokenizer, client) for sample_id in job.sample_ids]


def extract_one(state: RunState, sample_id: int, settings: ExtractorSettings, tokenizer,
                client: HiddenStateSource) -> SampleResult:
    """Settle one sample: done, skipped (already extracted) or failed (named on the volume)."""
    spec = cached_spec(settings.data, state.run)
    if state.is_done(Stage.EXTRACT, sample_id):
        if not spec.online.enabled or state.paths.hidden(sample_id).is_file():
            return SampleResult.SKIPPED
        # An online run's file deleted without its done bit cleared (a trainer killed between the two): the bit
        # is stale, and the trainer that asks for the sample again needs the file.
        release(state, sample_id)
    wait_for_headroom(state.conn, settings.data, state.run)  # a paused run's samples wait here instead of failing

    def landed(result: HiddenStatesResult, info: HiddenFileInfo) -> None:
        _record_manifest(state, sample_id, info)
        with state.conn.pipeline() as pipe:  # recorded first: a sample marked done implies the run's layer record
            _record_layers(pipe, state.run, result)
            pipe.execute()
        # The done bit and the file's counts in one atomic step: a kill between them would count it never or twice.
        state.mark_done(Stage.EXTRACT, sample_id, landed=landed_counts(info.nbytes, info.num_tokens))
        if spec.online.enabled:
            note_peak(state.conn, state.run)

    try:
        _extract(sample_id, spec, state, tokenizer, str(settings.model_dir), client, landed)
    except redis.RedisError:
        raise  # Redis away is no fault of the sample: the job fails and runs again once Redis is back
    except shutdown.JobYielded:
        raise  # the worker is stopping: this sample and the job's later ones go back to the queue, never failed
    except BudgetDeferred:
        return SampleResult.DEFERRED  # unsettled: the online trainer asks for it again when it needs it
    except Exception as exc:  # noqa: BLE001 - every sample must settle, or the run never reaches training
        if not isinstance(exc, DraftlineError):
            log.exception("run %s: sample %d: unexpected error", state.run, sample_id)
        state.mark_failed(Failure(run=state.run, stage=Stage.EXTRACT, sample_id=sample_id,
                                  error_class=error_class(exc), message=str(exc)))
        log.warning("run %s: sample %d extract failed: %s: %s", state.run, sample_id, error_class(exc), exc)
        return SampleResult.FAILED
    return SampleResult.DONE


def _extract(sample_id: int, spec: RunSpec, state: RunState, tokenizer, model_dir: str, client: HiddenStateSource,
             landed: Callable[[HiddenStatesResult, HiddenFileInfo], None]) -> None:
    """Extract the sample's file, verify it, and call ``landed`` with it while its bytes are still claimed: until
    ``landed`` has counted them in the run's meta, the claim is what keeps other extractions from taking them."""
    record = read_reply(state.paths.generated(sample_id))  # a missing or torn reply fails the sample first
    turn_end = turn_end_of(tokenizer, model_dir)
    path = state.paths.generated(sample_id)
    input_ids, loss_mask, unlearned = sample_of(record, tokenizer, turn_end, spec.extraction.max_length, path)
    if unlearned:
        log.warning("run %s: sample %d of %d turns: %s learned, the rest of each left out: from there the "
                    "conversation's tokens differ from what the target wrote (its chat template or tokenizer "
                    "renders the reply otherwise)", state.run, sample_id, len(record["turns"]),
                    "; ".join(map(str, unlearned)))
    # The file's bytes are claimed until they are counted as landed (free space, and an online run's spool, then
    # hold them instead).
    budget = spec.online.budget_bytes if spec.online.enabled else None
    with claim_space(state.conn, state.paths.data, state.run, sample_id, len(input_ids), budget=budget):
        granted = time.monotonic()
        result = client.extract(
            input_ids=input_ids, loss_mask=loss_mask, path=state.paths.hidden_relative(sample_id),
            layer_ids=spec.extraction.layer_ids, metadata={"run": state.run, "sample_id": str(sample_id)},
            storage=spec.extraction.storage, on_retry=lambda: state.note_retry(Stage.EXTRACT),
        )
        landed(result, _verified(state, spec, sample_id, input_ids, result))
        if budget is not None:  # beside the time blocked on the budget: the share of it the extractors wait
            add_seconds(state.conn, state.run, ONLINE_EXTRACT_S, time.monotonic() - granted)


def _verified(state: RunState, spec: RunSpec, sample_id: int, input_ids: list[int],
              result: HiddenStatesResult) -> HiddenFileInfo:
    """The file the server wrote, verified; a file that fails is deleted and the error raised."""
    path = state.paths.hidden(sample_id)
    try:
        info = verify_hidden_file(path, layer_ids=_run_layers(state, spec, result), sha256=result.sha256)
        if info.num_tokens != len(input_ids):
            raise HiddenStateFileError(f"{path}: {info.num_tokens} tokens, sent {len(input_ids)}")
        if (info.dtype == eagle3.FP8_DTYPE) != (spec.extraction.storage == "fp8"):
            raise HiddenStateFileError(f"{path}: states in {info.dtype}, the run stores them as "
                                       f"{spec.extraction.storage!r}")
    except HiddenStateFileError:
        path.unlink(missing_ok=True)  # a file that fails verification must never pass for finished work
        raise
    if result.layer_convention != eagle3.LAYER_CONVENTION:
        raise MalformedHiddenResponse(f"server reports layer convention {result.layer_convention!r}, "
                                      f"expected {eagle3.LAYER_CONVENTION!r}")
    return info


def _record_manifest(state: RunState, sample_id: int, info: HiddenFileInfo) -> None:
    """Append the verified file to its shard's manifest; a file the manifest cannot name must not stay."""
    try:
        entry = dataclasses.replace(ManifestEntry.from_info(sample_id, info), mtime_ns=info.path.stat().st_mtime_ns)
        append_entry(manifest_path(state.paths, sample_id), entry)
    except OSError:
        info.path.unlink(missing_ok=True)
        raise


def _run_layers(state: RunState, spec: RunSpec, result: HiddenStatesResult) -> list[int]:
    """The layer ids every file of the run must carry: the spec's, else those of the first verified sample."""
    if spec.extraction.layer_ids is not None:
        return list(spec.extraction.layer_ids)
    recorded = state.conn.hget(state.keys.meta, "layer_ids")  # one field, not the whole meta hash
    return json.loads(recorded) if recorded else list(result.layer_ids)


def _record_layers(pipe: redis.client.Pipeline, run: str, result: HiddenStatesResult) -> None:
    """First success wins (HSETNX), so concurrent extractors agree on one record; joins ``pipe``."""
    meta = RunKeys(run).meta
    pipe.hsetnx(meta, "layer_ids", json.dumps(result.layer_ids))
    pipe.hsetnx(meta, "layer_convention", result.layer_convention)
