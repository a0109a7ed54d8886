"""Speculative decoding against the real tiny target: exact greedy output, acceptance accounting, the
curve over k, the baselines, and the greedy-equality check."""

from __future__ import annotations

import pytest
import torch

from evaluation import evaluate, speculative, speculative_batch
from evaluation.evalsets import EvalSet
from evaluation.evaluate import EvalPrompt, evaluate_prompts, evaluate_sets, first_difference, verify_greedy_equality
from evaluation.speculative import DrafterProposer, accepted_prefix, speculative_generate
from evaluation.lookup import LookupProposer, NoProposer
from shared.errors import SpeculativeMismatch
from modeling.export import load_drafter
from shared.runspec import EvalConfig
from tests.support.tiny_runs import (
    LAYER_IDS,
    demo_messages,
    greedy_reply,
    prompt_ids,
)
from tests.support.acceptance import accepted_per_step, assert_report_matches, expected_report

MAX_NEW = 24


class OracleProposer:
    """Proposes the target's own greedy continuation, known in advance (``sequence`` = prompt + reply):
    every draft must be accepted. With ``wrong`` it proposes a different token every time."""

    def __init__(self, sequence: list[int], *, wrong: bool = False, vocab: int = 0) -> None:
        # ``extend`` hands over the token after each verified position; token 0 is never handed over.
        self.sequence, self.known, self.wrong, self.vocab = sequence, 1, wrong, vocab

    def extend(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        self.known += len(next_tokens)

    def propose(self, k: int) -> list[int]:
        tokens = (self.sequence[self.known : self.known + k] + [0] * k)[:k]
        return [(t + 1) % self.vocab for t in tokens] if self.wrong else tokens


def decode(target, proposer, messages, draft_steps=3, max_new=MAX_NEW):
    return speculative_generate(target.model, proposer, prompt_ids(target, messages), max_new_tokens=max_new,
                                draft_steps=draft_steps, layer_ids=LAYER_IDS)


@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_speculative_output_equals_the_targets_greedy_generate(which, request, tiny_target, eval_messages):
    drafter = request.getfixturevalue(f"{which}_drafter")
    for messages in [*eval_messages, *demo_messages()[:3]]:
        result = decode(tiny_target, DrafterProposer(drafter), messages)
        assert result.tokens == greedy_reply(tiny_target, messages, MAX_NEW)
        assert sum(result.accepted) + 1 == len(result.tokens)  # the prefill yields the first token


@pytest.mark.parametrize("draft_steps", [1, 3, 5])
def test_an_oracle_drafter_is_accepted_in_full_at_every_step_but_the_last(draft_steps, tiny_target, eval_messages):
    for messages in eval_messages:
        reference = greedy_reply(tiny_target, messages, MAX_NEW)
        oracle = OracleProposer(prompt_ids(tiny_target, messages) + reference)
        result = decode(tiny_target, oracle, messages, draft_steps=draft_steps)
        assert result.tokens == reference
        assert result.accepted[:-1] == [draft_steps + 1] * (result.steps - 1)
        # The last step is cut short by the budget or an eos: it emits what remains of the reply.
        assert result.accepted[-1] == (len(reference) - 1) - (result.steps - 1) * (draft_steps + 1) >= 1
        assert result.steps == -(-(len(reference) - 1) // (draft_steps + 1))


def test_an_always_wrong_drafter_yields_exactly_one_token_per_step(tiny_target, eval_messages):
    vocab = tiny_target.model.config.vocab_size
    for messages in eval_messages:
        reference = greedy_reply(tiny_target, messages, MAX_NEW)
        oracle = OracleProposer(prompt_ids(tiny_target, messages) + reference, wrong=True, vocab=vocab)
        result = decode(tiny_target, oracle, messages)
        assert result.tokens == reference and set(result.accepted) == {1} and result.acceptance_length == 1.0


def test_a_trained_drafter_is_accepted_more_often_on_what_it_learned(trained_drafter, untrained_drafter, tiny_target):
    learned = demo_messages()[:6]  # the prompts behind the training files
    mean = lambda d: sum(decode(tiny_target, DrafterProposer(d), m).acceptance_length for m in learned) / len(learned)
    trained, untrained = mean(trained_drafter), mean(untrained_drafter)
    assert trained >= 1.15 and trained > untrained + 0.1


def test_report_counts_steps_and_tokens_per_prompt(trained_drafter, tiny_target, eval_messages, tmp_path):
    # Held-out prompts and three the drafter learned, so some of its drafts are accepted.
    prompts = [EvalPrompt(100 + i, m) for i, m in enumerate([*eval_messages, *demo_messages()[:3]])]
    seen = []
    cfg = EvalConfig(max_new_tokens=MAX_NEW, draft_steps=2, curve_max_steps=1, baselines=False)  # the headline only
    report = evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_drafter, prompts, cfg,
                              progress=lambda d, t: seen.append((d, t)))
    # One report per decode of the batch (the drafter at k = 1 and 2): prompts done so far, rising to all of them.
    assert seen == [(len(prompts) // 2, len(prompts)), (len(prompts), len(prompts))]
    assert [row["sample_id"] for row in report["prompts"]] == list(range(100, 100 + len(prompts)))
    assert report["steps"] == sum(row["steps"] for row in report["prompts"]) and report["draft_steps"] == 2
    assert all(row["tokens"] == sum(row["accepted"]) + 1 for row in report["prompts"])
    expected = expected_report(tiny_target.model, tiny_target.tokenizer, trained_drafter, [p.messages for p in prompts],
                               draft_steps=2, max_new_tokens=MAX_NEW)
    assert_report_matches(report, expected)
    assert expected[1] > 1.0  # drafts were accepted: the number pinned is not the one any drafter gets


def test_exported_drafter_decodes_like_the_trained_one_up_to_bf16(trained_drafter, tiny_target, tmp_path, eval_messages):
    from modeling.export import export_drafter

    export_drafter(trained_drafter, tmp_path / "export", target_model="tiny", target_fingerprint=tiny_target.fingerprint)
    loaded = load_drafter(tmp_path / "export", tiny_target.model_dir).eval()
    messages = eval_messages[0]
    assert decode(tiny_target, DrafterProposer(loaded), messages).tokens == greedy_reply(tiny_target, messages, MAX_NEW)


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix([5, 6, 7], [5, 6, 9, 4]) == 2
    assert accepted_prefix([5, 6, 7], [1, 6, 7, 4]) == 0  # a later match after a miss does not count
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 4]) == 3


# ---- the curve, the baselines, the equality check ------------------------------------------------

@pytest.fixture(scope="module")
def curve_report(trained_drafter, tiny_target, eval_messages):
    # Held-out prompts and two the drafter learned, so the curve has accepted drafts to show.
    prompts = [EvalPrompt(200 + i, m) for i, m in enumerate([*eval_messages[:2], *demo_messages()[:2]])]
    cfg = EvalConfig(max_new_tokens=MAX_NEW, draft_steps=3)
    return prompts, cfg, evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_drafter, prompts, cfg)


def test_the_curve_at_each_k_equals_an_independent_recomputation(curve_report, trained_drafter, tiny_target):
    prompts, cfg, report = curve_report
    methods = report["methods"]
    assert set(methods) == {"drafter", "lookup", "no_drafter"}
    ids = [prompt_ids(tiny_target, p.messages) for p in prompts]
    for k in range(1, 8):
        expected = {
            "drafter": [accepted_per_step(tiny_target.model, trained_drafter, i, draft_steps=k, max_new_tokens=MAX_NEW)
                        for i in ids],
            "lookup": [accepted_per_step(tiny_target.model, None, i, draft_steps=k, max_new_tokens=MAX_NEW,
                                         lookup=(cfg.lookup_min, cfg.lookup_max)) for i in ids],
        }
        for method, rows in expected.items():
            assert [row["passes"][method][str(k)] for row in report["prompts"]] == [len(r) for r in rows], (method, k)
            assert methods[method]["curve"][str(k)] == sum(map(sum, rows)) / sum(map(len, rows)), (method, k)
    for method in ("drafter", "lookup"):
        assert list(methods[method]["curve"]) == [str(k) for k in range(1, 8)]
        assert methods[method]["curve"]["7"] > 1.0  # proposals were accepted: the numbers pinned mean something
    assert report["acceptance_length"] == methods["drafter"]["curve"]["3"]  # the headline is the curve at draft_steps


def test_the_margin_over_lookup_is_the_curves_difference_with_an_interval_from_the_same_prompts(curve_report):
    prompts, _, report = curve_report
    methods, margins = report["methods"], report["over_lookup"]
    assert list(margins) == [str(k) for k in range(1, 8)]  # every k both were decoded at
    for k, margin in margins.items():
        for method in ("drafter", "lookup"):  # the per-prompt counts it resamples add up to the curve's
            assert sum(row["emitted"][method][k] for row in report["prompts"]) == methods[method]["emitted"][k]
            assert sum(row["passes"][method][k] for row in report["prompts"]) == methods[method]["passes"][k]
        assert margin["difference"] == pytest.approx(methods["drafter"]["curve"][k] - methods["lookup"]["curve"][k])
        # Four prompts are too few to resample (margin.MIN_PROMPTS): the difference stands without an interval,
        # whose arithmetic test_margin checks.
        assert (margin["low"], margin["high"], margin["prompts"]) == (None, None, len(prompts))


def test_the_report_carries_the_one_pass_curves_beside_the_decoded_ones(curve_report):
    prompts, _, report = curve_report
    methods = report["methods"]
    for method in ("drafter", "lookup"):
        one_pass = methods[method]["one_pass"]
        assert list(one_pass["curve"]) == list(methods[method]["curve"])
        assert one_pass["emitted"] == methods[method]["emitted"]  # the same replies, every token counted once
        for k, value in one_pass["curve"].items():
            assert abs(value - methods[method]["curve"][k]) <= report["one_pass_apart"]
            # In float32 a drafter argmax within rounding of a tie may turn (test_one_pass pins the two pass for
            # pass in float64): a pass or so a prompt at most, never a walk that counts otherwise.
            assert abs(one_pass["passes"][k] - methods[method]["passes"][k]) <= len(prompts), (method, k)
    assert "one_pass" not in methods["no_drafter"]


def test_decoding_the_headline_alone_takes_the_rest_of_the_curve_from_one_pass(curve_report, trained_drafter,
                                                                               tiny_target):
    prompts, cfg, report = curve_report
    headline = cfg.model_copy(update={"decode": "headline"})
    quick = evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_drafter, prompts, headline)
    assert quick["decode"] == "headline" and report["decode"] == "curve"
    assert quick["greedy_check"]["checked"] == 3 * len(prompts)  # drafter and lookup at k = 3, and no drafter
    apart = 0.0
    for method in ("drafter", "lookup"):
        full, mine = report["methods"][method], quick["methods"][method]
        assert list(mine["curve"]) == [str(k) for k in range(1, 8)]
        assert mine["measured_by"] == {k: "decode" if k == "3" else "one_pass" for k in mine["curve"]}
        assert full["measured_by"] == dict.fromkeys(full["curve"], "decode")
        for k in mine["curve"]:
            source = full if k == "3" else full["one_pass"]  # the same decode, the same walk over the same replies
            assert (mine["curve"][k], mine["emitted"][k], mine["passes"][k]) == \
                   (source["curve"][k], source["emitted"][k], source["passes"][k]), (method, k)
        assert mine["one_pass"]["curve"] == full["one_pass"]["curve"]
        apart = max(apart, abs(full["curve"]["3"] - full["one_pass"]["curve"]["3"]))
        assert [row["passes"][method] for row in quick["prompts"]] == [{"3": row["passes"][method]["3"]}
                                                                       for row in report["prompts"]]
    assert quick["one_pass_apart"] == apart  # checked where both forms exist: the headline
    assert quick["acceptance_length"] == report["acceptance_length"]
    assert quick["over_lookup"] == {"3": report["over_lookup"]["3"]}  # per-prompt counts exist where decoded


def test_a_one_pass_fault_is_named_in_the_report_and_the_decoded_curves_stand(curve_report, trained_drafter,
                                                                            tiny_target, monkeypatch, caplog):
    prompts, cfg, report = curve_report
    calls = []

    def breaks_on_the_second_part(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return real(*args, **kwargs)

    real = evaluate.one_pass_counts
    monkeypatch.setattr(evaluate, "one_pass_counts", breaks_on_the_second_part)
    one_each = cfg.model_copy(update={"batch_tokens": 1})  # a part per prompt: the fault falls after a good part
    broken = evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_drafter, prompts, one_each)
    assert len(calls) == 2  # no part after the fault is measured
    assert broken["one_pass_error"] == "RuntimeError: CUDA out of memory (stand-in)"
    assert broken["one_pass_apart"] is None
    assert all("one_pass" not in m for m in broken["methods"].values())  # not a curve over the good part alone
    for method in ("drafter", "lookup"):
        assert broken["methods"][method]["curve"] == report["methods"][method]["curve"]
    assert report["one_pass_error"] is None
    assert "one-pass curves not measured" in caplog.text


def test_without_a_drafter_every_pass_emits_one_token_and_every_decode_matched_greedy(curve_report):
    prompts, _, report = curve_report
    plain = report["methods"]["no_drafter"]
    assert plain["acceptance_length"] == 1.0
    assert plain["passes"] == plain["emitted"] == sum(row["tokens"] - 1 for row in report["prompts"])
    assert [row["passes"]["no_drafter"] for row in report["prompts"]] == [row["tokens"] - 1 for row in report["prompts"]]
    # Per prompt: the drafter and lookup at k = 1..7, and no drafter.
    assert report["greedy_check"] == {"checked": len(prompts) * 15, "matched": len(prompts) * 15, "mismatches": [],
                                      "near_ties": [], "near_tie_logits": 1e-3}


def test_the_loop_takes_proposals_shorter_than_k_or_none_and_refuses_longer_ones(tiny_target, eval_messages):
    messages = eval_messages[0]
    reference, ids = greedy_reply(tiny_target, messages, MAX_NEW), prompt_ids(tiny_target, messages)
    plain = decode(tiny_target, NoProposer(), messages, draft_steps=4)
    assert plain.tokens == reference and set(plain.accepted) == {1}
    lookup = decode(tiny_target, LookupProposer(ids[0], min_n=1, max_n=3), messages, draft_steps=4)
    assert lookup.tokens == reference

    class Overeager(NoProposer):
        def propose(self, k: int) -> list[int]:
            return [0] * (k + 1)

    with pytest.raises(ValueError, match="Overeager proposed 5 tokens, more than the 4"):
        decode(tiny_target, Overeager(), messages, draft_steps=4)


def test_a_decode_that_departs_from_greedy_is_a_named_failure_naming_where(monkeypatch, untrained_drafter, tiny_target,
                                                                           eval_messages):
    # An accept rule that takes every draft: the untrained drafter's wrong drafts reach the output.
    for module in (speculative, speculative_batch):  # the batched loop the report uses, the single one below
        monkeypatch.setattr(module, "accepted_prefix", lambda drafts, greedy: len(drafts))
    prompts = [EvalPrompt(300, eval_messages[0])]
    cfg = EvalConfig(max_new_tokens=MAX_NEW, draft_steps=2, curve_max_steps=2)
    report = evaluate_sets(tiny_target.model, tiny_target.tokenizer, untrained_drafter, [EvalSet("holdout", prompts, [])], cfg)
    check = report["sets"]["holdout"]["greedy_check"]  # recorded in the report before anything is raised
    assert check["checked"] == 5 and check["matched"] == 5 - len(check["mismatches"]) < 5
    assert "no_drafter" not in {m["method"] for m in check["mismatches"]}  # nothing proposed, nothing wrongly taken
    # A wrong draft taken is one the target clearly did not prefer: never mistaken for a near tie.
    assert check["near_ties"] == [] and all(m["logit_gap"] > check["near_tie_logits"] for m in check["mismatches"])
    first = check["mismatches"][0]
    assert (first["set"], first["sample_id"], first["method"], first["k"]) == ("holdout", 300, "drafter", 1)
    wrong = decode(tiny_target, DrafterProposer(untrained_drafter), eval_messages[0], draft_steps=1).tokens
    assert first["position"] == first_difference(wrong, greedy_reply(tiny_target, eval_messages[0], MAX_NEW)) >= 1
    with pytest.raises(SpeculativeMismatch, match=rf"of 5 speculative decodes differ .* set holdout, prompt 300, "
                                                  rf"method drafter, k 1, first differing position {first['position']}"):
        verify_greedy_equality(report)


def test_sets_are_reported_each_and_the_first_is_the_headline(untrained_drafter, tiny_target, eval_messages):
    sets = [EvalSet("holdout", [EvalPrompt(1, eval_messages[0])], []),
            EvalSet("humaneval", [EvalPrompt(7, eval_messages[1]), EvalPrompt(8, eval_messages[2])], [3])]
    seen = []
    cfg = EvalConfig(max_new_tokens=8, draft_steps=2, curve_max_steps=1, baselines=False)
    report = evaluate_sets(tiny_target.model, tiny_target.tokenizer, untrained_drafter, sets, cfg,
                           progress=lambda d, t: seen.append((d, t)))
    # After each of a set's two decodes (k = 1, 2), its prompts' share; earlier sets count as done.
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert list(report["sets"]) == ["holdout", "humaneval"] and report["headline_set"] == "holdout"
    assert report["acceptance_length"] == report["sets"]["holdout"]["acceptance_length"]
    assert [row["sample_id"] for row in report["prompts"]] == [1]
    assert report["sets"]["humaneval"]["excluded"] == [3]
    assert list(report["sets"]["humaneval"]["methods"]["drafter"]["curve"]) == ["1", "2"]  # draft_steps beyond the curve
    verify_greedy_equality(report)


def test_first_difference_counts_a_missing_token():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3, 4], [1, 2, 3]) == 3


def test_a_departure_at_a_near_tie_is_counted_apart_and_any_other_stays_a_mismatch():
    prompt, measured = EvalPrompt(5, []), evaluate.SetRun("holdout", tolerance=1e-3)
    reference = [1, 2, 3, 4]
    measured.record(prompt, "drafter", 2, evaluate.DecodeResult([1, 2, 3, 4], [2, 2]), reference, lambda *_: 9.0)
    measured.record(prompt, "drafter", 3, evaluate.DecodeResult([1, 2, 9, 9], [2, 2]), reference, lambda *_: 2e-4)
    measured.record(prompt, "lookup", 3, evaluate.DecodeResult([1, 7, 7, 7], [2, 2]), reference, lambda *_: 0.5)
    measured.record(prompt, "lookup", 1, evaluate.DecodeResult([1, 2], [1]), reference, lambda *_: None)
    assert measured.checked == 4
    assert measured.near_ties == [{"set": "holdout", "sample_id": 5, "method": "drafter", "k": 3, "position": 2,
                                   "logit_gap": 2e-4}]
    assert [(m["method"], m["k"], m["position"], m.get("logit_gap")) for m in measured.mismatches] == [
        ("lookup", 3, 1, 0.5), ("lookup", 1, 2, None)]  # a missing token has no gap: a mismatch


def test_the_logit_gap_is_the_targets_own_preference_between_the_two_tokens(tiny_target, eval_messages):
    ids = prompt_ids(tiny_target, eval_messages[0])
    reference = greedy_reply(tiny_target, eval_messages[0], 4)
    with torch.inference_mode():
        logits = tiny_target.model(torch.tensor([ids + reference[:2]])).logits[0, -1]
    other = int(logits.argsort(descending=True)[1])  # the runner-up
    gap = evaluate.logit_gap(tiny_target.model, ids, reference, 2, [*reference[:2], other])
    assert gap == pytest.approx(float(logits[reference[2]] - logits[other]), abs=1e-6) and gap > 0


def test_a_second_turn_follows_the_targets_own_greedy_first_reply(trained_drafter, tiny_target, eval_messages):
    first, second = eval_messages[0], eval_messages[1]
    prompt = EvalPrompt(40, second, (tuple(first),))
    with pytest.raises(ValueError, match="answer_earlier_turns"):
        evaluate.prompt_ids_of(tiny_target.tokenizer, prompt)  # its context is not known before the target answers
    (answered,) = evaluate.answer_earlier_turns(tiny_target.model, tiny_target.tokenizer, [prompt],
                                                EvalConfig(earlier_reply_tokens=20))
    reply = tiny_target.tokenizer.decode(greedy_reply(tiny_target, first, 20), skip_special_tokens=True).strip()
    assert reply and answered.messages == [*first, {"role": "assistant", "content": reply}, *second]
    assert answered.earlier == ()
    cfg = EvalConfig(max_new_tokens=MAX_NEW, draft_steps=2, curve_max_steps=2, earlier_reply_tokens=20)
    report = evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_drafter, [prompt], cfg,
                              name="holdout_turn2")
    (row,) = report["prompts"]
    assert row["prompt_tokens"] == len(evaluate.prompt_ids_of(tiny_target.tokenizer, answered))
    assert row["reply"] == greedy_reply(tiny_target, answered.messages, MAX_NEW)[: len(row["reply"])]
    assert report["greedy_check"]["mismatches"] == []


def test_a_prompt_longer_than_the_limit_is_left_out_named_and_the_others_measured(trained_drafter, tiny_target,
                                                                                   eval_messages):
    short, other = eval_messages[0], eval_messages[1]
    long = [{"role": "user", "content": " ".join(["a long prompt"] * 60)}]
    limit = len(prompt_ids(tiny_target, short)) + 4
    assert len(prompt_ids(tiny_target, long)) > limit >= len(prompt_ids(tiny_target, other))
    prompts = [EvalPrompt(0, short), EvalPrompt(1, long), EvalPrompt(2, other),
               EvalPrompt(3, other, (tuple(long),))]  # a second turn whose first turn is too long to answer
    cfg = EvalConfig(max_new_tokens=8, draft_steps=2, curve_max_steps=2, earlier_reply_tokens=8,
                     max_prompt_tokens=limit, batch_prompts=2)
    seen = []
    report = evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_drafter, prompts, cfg,
                              lambda done, total: seen.append((done, total)))
    assert [row["sample_id"] for row in report["prompts"]] == [0, 2]
    assert report["too_long"] == [{"sample_id": 1, "prompt_tokens": len(prompt_ids(tiny_target, long)), "limit": limit},
                                  {"sample_id": 3, "prompt_tokens": len(prompt_ids(tiny_target, long)), "limit": limit}]
    assert report["greedy_check"]["mismatches"] == []
    assert seen[-1] == (4, 4)  # a prompt left out counts as settled
    assert all(row["reply"] == greedy_reply(tiny_target, p.messages, 8)[: len(row["reply"])]
               for row, p in zip(report["prompts"], [prompts[0], prompts[2]]))


def test_the_prompt_limit_leaves_the_targets_context_room_for_the_reply_and_the_drafts(tiny_target):
    context = tiny_target.model.config.max_position_embeddings
    cfg = EvalConfig(max_new_tokens=64, draft_steps=3, curve_max_steps=7, max_prompt_tokens=context)
    assert evaluate.prompt_limit(tiny_target.model, cfg) == context - 64 - 7 - 1
    assert evaluate.prompt_limit(tiny_target.model, cfg.model_copy(update={"max_prompt_tokens": 16})) == 16


def test_token_batches_cut_consecutive_rows_within_the_budget():
    ids = [[0] * n for n in (10, 10, 30, 5, 5, 5, 100)]
    parts = evaluate.token_batches(ids, budget=80, reply_tokens=10)
    assert parts == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]  # 2 x 20, 2 x 40, 2 x 15, 110 alone
    assert [i for part in parts for i in part] == list(range(len(ids)))
    assert evaluate.token_batches([], budget=80, reply_tokens=10) == []


def test_batches_cut_by_tokens_measure_what_one_batch_measures(trained_drafter, tiny_target, eval_messages):
    prompts = [EvalPrompt(i, m) for i, m in enumerate(eval_messages)]
    whole = EvalConfig(max_new_tokens=12, draft_steps=2, curve_max_steps=2)
    widest = max(len(prompt_ids(tiny_target, m)) for m in eval_messages) + 12
    cut = whole.model_copy(update={"batch_tokens": widest})  # one row a batch
    reports = [evaluate_prompts(tiny_target.model, tiny_target.tokenizer, trained_drafter, prompts, cfg)
               for cfg in (whole, cut)]
    assert reports[0]["prompts"] == reports[1]["prompts"]
    assert reports[0]["methods"] == reports[1]["methods"]
    assert reports[1]["greedy_check"]["mismatches"] == [] and len(reports[1]["prompts"]) == len(prompts) > 1
