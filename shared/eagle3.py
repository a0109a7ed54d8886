"""EAGLE-3 conventions shared by extraction, training and export (see EAGLE3.md).

Layer ids are *outputs of 0-indexed decoder layers*; in Hugging Face ``output_hidden_states`` terms
(index 0 is the embeddings) layer id ``i`` is ``hidden_states[i + 1]``. Every hidden-state file and
every checkpoint records the ids together with this convention name.
"""

from __future__ import annotations

LAYER_CONVENTION = "decoder_output_0idx"

# Tensor names inside one hidden-state safetensors file.
INPUT_IDS = "input_ids"  # [L] int64
LOSS_MASK = "loss_mask"  # [L] uint8, 1 on assistant tokens the drafter learns
AUX_HIDDEN = "aux_hidden_states"  # [L, 3H], the three auxiliary layers concatenated low, mid, high
LAST_HIDDEN = "hidden_states"  # [L, H], after the final norm: the input of the target's lm_head
SAMPLE_TENSORS = (INPUT_IDS, LOSS_MASK, AUX_HIDDEN, LAST_HIDDEN)

# fp8 storage (a run's ``extraction.storage = "fp8"``): both states as float8 e4m3 ("F8_E4M3"), each with a
# bf16 scale per token and stored layer, the token's largest magnitude in that layer over FP8_MAX, so that
# value lands on e4m3's largest finite value. state = e4m3 value × its scale. Per token, not per channel:
# measured on SmolLM2 (bench/RESULTS.md, "fp8 hidden states") per-token scales reconstruct every layer
# better, and their size does not depend on the sample's length.
FP8_DTYPE = "F8_E4M3"
FP8_MAX = 448.0  # e4m3fn's largest finite value; it has no infinity
SCALE_DTYPE = "BF16"
AUX_SCALE = "aux_hidden_states_scale"  # [L, 3]: low, mid, high
LAST_SCALE = "hidden_states_scale"  # [L, 1]
SCALES = {AUX_HIDDEN: (AUX_SCALE, 3), LAST_HIDDEN: (LAST_SCALE, 1)}  # state -> (its scale, layers it holds)

# Metadata keys (safetensors metadata is str -> str).
META_FORMAT = "format"
META_FORMAT_VALUE = "draftline-hidden-states"
META_SCHEMA = "schema_version"
META_LAYER_IDS = "layer_ids"  # JSON list
META_CONVENTION = "layer_convention"
META_MODEL = "model"
META_MODEL_FINGERPRINT = "model_fingerprint"
META_DTYPE = "dtype"


def default_layer_ids(num_layers: int) -> list[int]:
    """Low, middle and high auxiliary layers: ``[1, N//2 - 1, N - 4]`` (Kimi-K2, 61 layers: [1, 29, 57])."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target of at least 4 layers, got {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


def hf_hidden_index(layer_id: int) -> int:
    """Index into Hugging Face ``output_hidden_states`` for the output of decoder layer ``layer_id``."""
    return layer_id + 1


def engine_layer_id(layer_id: int) -> int:
    """vLLM's id (``eagle_aux_hidden_state_layer_ids``) for draftline's ``layer_id``: vLLM counts as
    ``output_hidden_states`` does (0 the embeddings, k the output of decoder layer k - 1)."""
    return hf_hidden_index(layer_id)


def layer_id_of_engine(engine_id: int) -> int:
    """draftline's layer id for vLLM's ``engine_id`` (the inverse of ``engine_layer_id``)."""
    return engine_id - 1


def engine_saved_layers(layer_ids: list[int], num_layers: int) -> list[int]:
    """What a vLLM server must save for a sample with these auxiliary layers: their engine ids and
    ``num_layers``, vLLM's id of the last layer's output before the final norm, ascending (vLLM stores
    them so)."""
    return sorted({*(engine_layer_id(i) for i in layer_ids), num_layers})


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    if len(layer_ids) != 3:
        raise ValueError(f"EAGLE-3 uses exactly three auxiliary layers, got {layer_ids}")
    for layer in layer_ids:
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer id {layer} is outside the target's {num_layers} layers")
        if layer == num_layers - 1:
            # Hugging Face's hidden_states[N] is the last layer's output *after* the final norm, vLLM's id N the
            # same output before it, and SGLang has no layer N + 1 to capture at: three readings of one id. A
            # drafter trained on it was served by vLLM at 1.63 where the evaluator measured 1.90 (k = 1).
            raise ValueError(f"layer id {layer} is the target's last decoder layer, which the engines read "
                             f"differently (vLLM before the final norm, Hugging Face after it); choose ids below {layer}")
    return list(layer_ids)
