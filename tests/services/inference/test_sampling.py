import torch

from services.inference.sampling import SamplingParams, make_generator, next_tokens, top_p_filter


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.125, 0.5, 0.25, 0.125])
    assert top_p_filter(probs, 0.7).tolist() == [0.0, 0.5, 0.25, 0.0]
    assert top_p_filter(probs, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0]  # the top token alone reaches p
    assert top_p_filter(probs, 0.01).tolist() == [0.0, 0.5, 0.0, 0.0]  # never empty
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_greedy_rows_take_the_argmax_and_need_no_generator():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    params = [SamplingParams(), SamplingParams()]
    assert [make_generator(p, torch.device("cpu")) for p in params] == [None, None]
    assert next_tokens(logits, params, [None, None]).tolist() == [1, 0]


def test_seeded_rows_sample_the_same_tokens_whatever_their_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    other = SamplingParams(temperature=1.5, seed=8)

    def draw(rows: list[SamplingParams], row_logits: torch.Tensor) -> list[int]:
        generators = [make_generator(p, torch.device("cpu")) for p in rows]
        return [next_tokens(row_logits, rows, generators).tolist() for _ in range(20)]

    alone = [step[0] for step in draw([seeded], logits[:1])]
    beside = [step[1] for step in draw([other, seeded, SamplingParams()], logits[[1, 0, 2]])]
    assert alone == beside
    assert len(set(alone)) > 1  # it really samples


def test_top_p_sampling_never_draws_outside_the_nucleus():
    logits = torch.tensor([[4.0, 3.9, -5.0, -5.0, -5.0]])
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=3)]
    generators = [make_generator(params[0], torch.device("cpu"))]
    drawn = {int(next_tokens(logits, params, generators)[0]) for _ in range(200)}
    assert drawn == {0, 1}
