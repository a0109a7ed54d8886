"""Layer ids read from either engine's field into ours once, and a base checkpoint's fit to the target."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.drafter_format import TargetFacts, check_base_fits, layer_ids_of, layer_ids_source
from shared.errors import BaseCheckpointMismatch, CheckpointFormatError

TINY = TargetFacts(hidden_size=64, vocab_size=774, num_layers=8, fingerprint="a" * 64)
PUBLISHED = {"hidden_size": 64, "vocab_size": 774}


@pytest.mark.parametrize(("fields", "source", "ours"), [
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}},
     "eagle_config.eagle_aux_hidden_state_layer_ids", [1, 3, 4]),  # SGLang's: outputs of layers, as ours
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, "eagle_aux_hidden_state_layer_ids", [1, 3, 4]),  # vLLM's: + 1
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}},
     "eagle_config.eagle_aux_hidden_state_layer_ids", [1, 3, 4]),  # both, agreeing: read once, not shifted twice
    ({"draftline": {"layer_ids": [1, 3, 4]}, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, "draftline.layer_ids", [1, 3, 4]),
    ({}, "default", None),
])
def test_layer_ids_come_from_one_field_in_our_convention(fields, source, ours):
    assert layer_ids_source(fields) == (source, ours)
    assert layer_ids_of(fields, 8) == (ours or [1, 3, 4])


def test_engine_fields_that_name_different_layers_are_refused():
    fields = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    with pytest.raises(CheckpointFormatError, match="the two engines would read different layers"):
        layer_ids_source(fields)
    with pytest.raises(CheckpointFormatError, match="expected a list of layer ids"):
        layer_ids_source({"eagle_aux_hidden_state_layer_ids": "2,4,5"})


def test_target_facts_read_a_multimodal_targets_language_model():
    facts = TargetFacts.from_config({"text_config": {"hidden_size": 64, "vocab_size": 774, "num_hidden_layers": 8}}, "a" * 64)
    assert facts == TINY


def test_every_misfit_is_named_with_both_values_in_one_error():
    config = {**PUBLISHED, "target_hidden_size": 32, "vocab_size": 800, "eagle_aux_hidden_state_layer_ids": [2, 4, 9]}
    with pytest.raises(BaseCheckpointMismatch) as info:
        check_base_fits(Path("base"), config, TINY)
    message = str(info.value)
    assert "target_hidden_size is 32, the target's hidden_size is 64" in message
    assert "vocab_size is 800, the target's vocab_size is 774" in message
    assert "eagle_aux_hidden_state_layer_ids is [2, 4, 9] (layer outputs [1, 3, 8]), the target has num_hidden_layers 8" in message


def test_a_fitting_base_gives_our_layer_ids_and_unknown_facts_are_not_compared():
    assert check_base_fits(Path("base"), {**PUBLISHED, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, TINY) == [1, 3, 4]
    assert check_base_fits(Path("base"), PUBLISHED, TINY) == [1, 3, 4]  # no ids: the target's default
    recorded = {**PUBLISHED, "draftline": {"layer_ids": [1, 3, 4], "target_fingerprint": "b" * 64}}
    assert check_base_fits(Path("base"), recorded, TargetFacts()) == [1, 3, 4]
    with pytest.raises(BaseCheckpointMismatch, match=f"draftline.target_fingerprint is {'b' * 64}, the target's "
                                                     f"fingerprint is {'a' * 64}"):
        check_base_fits(Path("base"), recorded, TINY)
