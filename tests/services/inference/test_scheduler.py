"""The chat scheduler with the real decode loop: how requests become batches."""

import threading

import pytest

from services.inference.decode import GenerationRequest, generate_batch
from services.inference.scheduler import ChatScheduler


class RecordingDecode:
    """The real ``generate_batch``, noting each batch's size; ``gate`` holds the first batch back."""

    def __init__(self, loaded) -> None:
        self.loaded = loaded
        self.sizes: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, requests):
        self.entered.set()
        self.gate.wait(30)
        self.sizes.append(len(requests))
        return generate_batch(self.loaded, requests)


def request(loaded, text: str, max_new: int = 4) -> GenerationRequest:
    return GenerationRequest(loaded.tokenizer.encode(text), max_new)


def test_queued_requests_fill_batches_up_to_the_limit(loaded_tiny):
    decode = RecordingDecode(loaded_tiny)
    scheduler = ChatScheduler(decode, max_batch_size=3, batch_wait_s=0.5)
    futures = [scheduler.submit(request(loaded_tiny, f"prompt number {i}")) for i in range(5)]
    scheduler.start()
    results = [f.result(30) for f in futures]
    scheduler.stop()
    # Three fill the first batch at once; the last two wait out batch_wait_s, then run together.
    assert decode.sizes == [3, 2]
    solo = [generate_batch(loaded_tiny, [request(loaded_tiny, f"prompt number {i}")])[0] for i in range(5)]
    assert [r.token_ids for r in results] == [r.token_ids for r in solo]


def test_requests_arriving_during_a_batch_form_the_next(loaded_tiny):
    decode = RecordingDecode(loaded_tiny)
    decode.gate.clear()
    scheduler = ChatScheduler(decode, max_batch_size=8, batch_wait_s=0.0).start()
    first = scheduler.submit(request(loaded_tiny, "first"))
    assert decode.entered.wait(30)
    later = [scheduler.submit(request(loaded_tiny, f"later {i}")) for i in range(3)]
    decode.gate.set()
    for future in [first, *later]:
        future.result(30)
    scheduler.stop()
    assert decode.sizes == [1, 3]


def test_cancelled_request_is_not_decoded(loaded_tiny):
    decode = RecordingDecode(loaded_tiny)
    scheduler = ChatScheduler(decode, max_batch_size=4, batch_wait_s=0.0)
    gone = scheduler.submit(request(loaded_tiny, "client went away"))
    kept = scheduler.submit(request(loaded_tiny, "still here"))
    assert gone.cancel()
    scheduler.start()
    kept.result(30)
    scheduler.stop()
    assert decode.sizes == [1]


def test_a_failing_batch_fails_each_of_its_requests_and_the_scheduler_goes_on(loaded_tiny):
    calls = []

    def decode(requests):
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("device fault")
        return generate_batch(loaded_tiny, requests)

    scheduler = ChatScheduler(decode, max_batch_size=2, batch_wait_s=0.0)
    failed = [scheduler.submit(request(loaded_tiny, "a")), scheduler.submit(request(loaded_tiny, "b"))]
    scheduler.start()
    for future in failed:
        with pytest.raises(RuntimeError, match="device fault"):
            future.result(30)
    assert scheduler.submit(request(loaded_tiny, "c")).result(30).token_ids
    scheduler.stop()


def test_stop_finishes_what_is_queued(loaded_tiny):
    decode = RecordingDecode(loaded_tiny)
    scheduler = ChatScheduler(decode, max_batch_size=1, batch_wait_s=0.0)
    futures = [scheduler.submit(request(loaded_tiny, f"q{i}")) for i in range(3)]
    scheduler.start()
    scheduler.stop()
    assert all(f.done() and f.result().token_ids for f in futures)


def test_an_empty_prompt_or_budget_is_refused_at_submission_not_in_its_batch(loaded_tiny):
    decode = RecordingDecode(loaded_tiny)
    scheduler = ChatScheduler(decode, max_batch_size=4, batch_wait_s=0.2)
    for bad in (GenerationRequest([], 4), GenerationRequest([1, 2], 0)):
        with pytest.raises(ValueError, match="non-empty prompt and max_new_tokens >= 1"):
            scheduler.submit(bad)
    good = scheduler.submit(request(loaded_tiny, "hello"))
    scheduler.start()
    assert len(good.result(30).token_ids) <= 4
    scheduler.stop()
    assert decode.sizes == [1]  # nothing refused reached a batch
