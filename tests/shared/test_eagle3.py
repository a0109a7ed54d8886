import pytest

from shared.eagle3 import check_layer_ids, default_layer_ids, hf_hidden_index


def test_default_layer_ids_follow_the_eagle3_convention():
    assert default_layer_ids(61) == [1, 29, 57]  # Kimi-K2
    assert default_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B
    assert default_layer_ids(8) == [1, 3, 4]  # the tiny target


def test_hf_index_counts_the_embeddings_as_zero():
    assert [hf_hidden_index(i) for i in default_layer_ids(61)] == [2, 30, 58]


def test_layer_ids_are_checked():
    with pytest.raises(ValueError):
        check_layer_ids([1, 2], 8)
    with pytest.raises(ValueError):
        check_layer_ids([1, 2, 8], 8)
    with pytest.raises(ValueError):
        default_layer_ids(3)


def test_the_last_decoder_layer_is_no_auxiliary_layer():
    """Its output reaches Hugging Face's hidden_states after the final norm and vLLM's aux capture before it:
    a drafter trained on it would be served on other inputs than it learned (tests/engines/test_vllm_acceptance.py
    measured that gap before this check)."""
    assert check_layer_ids([1, 3, 6], 8) == [1, 3, 6]
    with pytest.raises(ValueError, match="last decoder layer"):
        check_layer_ids([1, 3, 7], 8)
