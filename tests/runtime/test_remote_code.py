"""A target whose tokenizer is code in its own directory (as Kimi-K2.5's is) loads only with
``DRAFTLINE_TRUST_REMOTE_CODE``; without it the loader refuses by name, and never asks on stdin.

The directory here is the smallest such target: ``tokenizer_config.json`` maps ``AutoTokenizer`` to a
character tokenizer in ``tokenization_toy.py`` beside it (``auto_map``), a class transformers does not
have. The extractor's loader is the one exercised; the trainer and the built-in server call the same
``load_from_target``. transformers copies the module into its modules cache when it runs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.extractor.jobs import load_tokenizer
from shared.errors import RemoteCodeRefused
from runtime.remote_code import SETTING, load_from_target
from shared.settings import ExtractorSettings, InferenceSettings, TrainerSettings, env_name, load_settings

TOKENIZER_CODE = '''
from transformers import PreTrainedTokenizer


class ToyTokenizer(PreTrainedTokenizer):
    """One token per printable ASCII character."""

    def __init__(self, **kwargs):
        self.chars = [chr(c) for c in range(32, 127)]
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.chars)

    def get_vocab(self):
        return {c: i for i, c in enumerate(self.chars)}

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.chars.index(token)

    def _convert_id_to_token(self, index):
        return self.chars[index]

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def write_config(root: Path, config: dict) -> Path:
    root.mkdir()
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


@pytest.fixture()
def coded_target(tmp_path: Path) -> Path:
    root = write_config(tmp_path / "coded-target", {
        "tokenizer_class": "ToyTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_toy.ToyTokenizer", None]}})
    (root / "tokenization_toy.py").write_text(TOKENIZER_CODE)
    return root


def test_a_tokenizer_that_is_code_in_its_directory_is_refused_by_name_without_the_setting(coded_target):
    with pytest.raises(RemoteCodeRefused) as refused:
        load_tokenizer(str(coded_target))
    assert f"{SETTING}=true" in str(refused.value)
    assert "AutoTokenizer -> ['tokenization_toy.ToyTokenizer', None]" in str(refused.value)


def test_with_the_setting_the_directorys_own_tokenizer_loads(coded_target):
    tokenizer = load_tokenizer(str(coded_target), True)
    assert type(tokenizer).__name__ == "ToyTokenizer"
    assert tokenizer("hi", add_special_tokens=False)["input_ids"] == [ord("h") - 32, ord("i") - 32]


def test_a_directory_without_code_keeps_its_own_error(tmp_path):
    from transformers import AutoTokenizer

    root = write_config(tmp_path / "no-code", {"tokenizer_class": "NoSuchTokenizer"})
    with pytest.raises(ValueError) as failed:  # transformers' own; RemoteCodeRefused is no ValueError
        load_from_target(AutoTokenizer.from_pretrained, root, trust_remote_code=False)
    assert SETTING not in str(failed.value)


@pytest.mark.parametrize("cls", [InferenceSettings, ExtractorSettings, TrainerSettings])
def test_each_service_that_loads_the_target_reads_the_setting_off_by_default(cls, monkeypatch, tmp_path):
    assert env_name(cls, "trust_remote_code") == SETTING
    monkeypatch.chdir(tmp_path)  # no .env from the working directory
    monkeypatch.delenv(SETTING, raising=False)
    assert load_settings(cls, model_dir=tmp_path).trust_remote_code is False
    monkeypatch.setenv(SETTING, "true")
    assert load_settings(cls, model_dir=tmp_path).trust_remote_code is True
