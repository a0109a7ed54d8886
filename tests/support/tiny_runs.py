"""Runs of the tiny target for the trainer's, the evaluation's and the engines' tests: hidden-state files made
from the tiny target with a real forward pass, and drafters trained on them (a plugin of tests/conftest.py).

Each sample is a prompt from the shipped demo prompts plus the reply the tiny target itself generates
greedily, rendered by its chat template (assistant tokens masked in), so the drafter has the target's own
behaviour to learn. Files carry the metadata of shared.eagle3 and pass verify_hidden_file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shared import SCHEMA_VERSION, eagle3
from shared.layout import RunPaths
from shared.runspec import EvalConfig, ExtractionConfig, RunSpec, TrainConfig

LAYER_IDS = [1, 3, 4]  # default for the 8-layer tiny target
NUM_TRAIN = 16
NUM_EVAL = 4
REPLY_TOKENS = 24
MODEL_NAME = "tiny"


@dataclass(frozen=True)
class TinyTarget:
    model: object  # transformers LlamaForCausalLM
    tokenizer: object
    model_dir: Path
    fingerprint: str


def fingerprint_of(model_dir: Path) -> str:
    """sha256 of the canonical config JSON (how the inference server fingerprints a target)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def demo_messages() -> list[list[dict]]:
    """The shipped demo prompts as chat messages (the file mixes three row formats)."""
    text = resources.files("shared").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    found = []
    for line in text.splitlines():
        row = json.loads(line)
        if "messages" in row:
            found.append(row["messages"])
        elif "conversations" in row:
            found.append([{"role": "user", "content": turn["value"]} for turn in row["conversations"] if turn["from"] == "human"][:1])
        elif "prompt" in row:
            found.append([{"role": "user", "content": row["prompt"]}])
    return [m for m in found if m]


@pytest.fixture(scope="session")
def tiny_target(tiny_model_dir: Path) -> TinyTarget:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return TinyTarget(model, AutoTokenizer.from_pretrained(tiny_model_dir), tiny_model_dir, fingerprint_of(tiny_model_dir))


def prompt_ids(target: TinyTarget, messages: list[dict]) -> list[int]:
    return list(target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])


@torch.inference_mode()
def greedy_reply(target: TinyTarget, messages: list[dict], max_new_tokens: int = REPLY_TOKENS) -> list[int]:
    ids = prompt_ids(target, messages)
    out = target.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(ids):].tolist()


@torch.inference_mode()
def make_sample(target: TinyTarget, messages: list[dict], layer_ids: list[int] = LAYER_IDS,
                reply_tokens: int = REPLY_TOKENS) -> dict[str, torch.Tensor]:
    reply = target.tokenizer.decode(greedy_reply(target, messages, reply_tokens), skip_special_tokens=True)
    conversation = [*messages, {"role": "assistant", "content": reply}]
    rendered = target.tokenizer.apply_chat_template(conversation, return_assistant_tokens_mask=True, return_dict=True)
    ids = torch.tensor(rendered["input_ids"], dtype=torch.int64)
    out = target.model(ids[None], output_hidden_states=True)
    aux = torch.cat([out.hidden_states[eagle3.hf_hidden_index(i)][0] for i in layer_ids], dim=-1)  # (L, 3H)
    return {
        eagle3.INPUT_IDS: ids,
        eagle3.LOSS_MASK: torch.tensor(rendered["assistant_masks"], dtype=torch.uint8),
        eagle3.AUX_HIDDEN: aux.contiguous(),
        eagle3.LAST_HIDDEN: out.hidden_states[-1][0].contiguous(),  # final-norm output, lm_head's input
    }


def file_metadata(target: TinyTarget, layer_ids: list[int] = LAYER_IDS) -> dict[str, str]:
    return {
        eagle3.META_FORMAT: eagle3.META_FORMAT_VALUE,
        eagle3.META_SCHEMA: str(SCHEMA_VERSION),
        eagle3.META_LAYER_IDS: json.dumps(layer_ids),
        eagle3.META_CONVENTION: eagle3.LAYER_CONVENTION,
        eagle3.META_MODEL: MODEL_NAME,
        eagle3.META_MODEL_FINGERPRINT: target.fingerprint,
        eagle3.META_DTYPE: "float32",
    }


@pytest.fixture(scope="session")
def tiny_samples(tiny_target: TinyTarget) -> list[dict[str, torch.Tensor]]:
    return [make_sample(tiny_target, m) for m in demo_messages()[:NUM_TRAIN]]


@pytest.fixture(scope="session")
def eval_messages() -> list[list[dict]]:
    return demo_messages()[NUM_TRAIN : NUM_TRAIN + NUM_EVAL]


def stored(tensors: dict[str, torch.Tensor], storage: str) -> dict[str, torch.Tensor]:
    """A sample's tensors as a file of ``storage`` holds them: fp8 through the built-in server's own quantizer."""
    if storage != "fp8":
        return tensors
    from modeling.fp8 import quantize_fp8

    out = dict(tensors)
    for name, (scale_name, layers) in eagle3.SCALES.items():
        out[name], out[scale_name] = quantize_fp8(tensors[name], layers)
    return out


def write_run(
    data: Path, name: str, target: TinyTarget, samples: list[dict[str, torch.Tensor]], eval_messages: list[list[dict]],
    *, train: dict | None = None, evaluate: dict | None = None, storage: str = "target",
    layer_ids: list[int] | None = None,
) -> RunPaths:
    """A prepared run directory: run.json, one hidden-state file per sample, held-out prompts. ``layer_ids``:
    the samples' auxiliary layers, where they are not the target's default."""
    train_cfg = {"epochs": 2, "batch_size": 4, "lr": 3e-3, "warmup_ratio": 0.1, "ttt_steps": 3,
                 "draft_vocab_size": 256, "save_every": 4, **(train or {})}
    spec = RunSpec(name=name, dataset="tiny-demo", model=MODEL_NAME, rows=len(samples) + len(eval_messages),
                   train_ids=len(samples), train=TrainConfig(**train_cfg), evaluate=EvalConfig(**(evaluate or {})),
                   extraction=ExtractionConfig(storage=storage, layer_ids=layer_ids))
    spec.save(data)
    paths = RunPaths(data, name)
    for sample_id, tensors in enumerate(samples):
        path = paths.hidden(sample_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(stored(tensors, storage), str(path), metadata=file_metadata(target, layer_ids or LAYER_IDS))
    rows = [{"sample_id": len(samples) + i, "messages": m} for i, m in enumerate(eval_messages)]
    (paths.root / "eval_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


@pytest.fixture()
def make_run(data_dir: Path, tiny_target: TinyTarget, tiny_samples, eval_messages):
    def make(name: str = "tiny", **overrides) -> RunPaths:
        return write_run(data_dir, name, tiny_target, tiny_samples, eval_messages, **overrides)

    return make


@pytest.fixture()
def job_settings(monkeypatch, redis_url, data_dir, tiny_model_dir):
    """The job functions called in this process, configured through the environment like the worker."""
    from services.trainer import jobs

    for name, value in {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
                        "DRAFTLINE_DEVICE": "cpu"}.items():
        monkeypatch.setenv(name, value)
    jobs.get_settings.cache_clear()
    yield jobs
    jobs.get_settings.cache_clear()


@pytest.fixture(scope="session")
def trained_drafter(tmp_path_factory, tiny_target, tiny_samples, eval_messages):
    """A drafter trained on the tiny target's own replies: some of its drafts are accepted."""
    from services.trainer.train import train_drafter

    data = tmp_path_factory.mktemp("eval") / "data"
    data.mkdir()
    write_run(data, "trained", tiny_target, tiny_samples, eval_messages, train={"epochs": 40, "lr": 1e-2, "save_every": 1000})
    result = train_drafter(RunSpec.load(data, "trained"), data=data, model_dir=tiny_target.model_dir, device="cpu")
    return result.drafter.eval()


# A DFlash drafter small enough to train in seconds: blocks of 4 (3 drafts a pass), 2 layers.
DFLASH_TRAIN = {"method": "dflash", "dflash": {"block_size": 4, "layers": 2, "anchors": 16}}


@pytest.fixture(scope="session")
def trained_dflash(tmp_path_factory, tiny_target, tiny_samples, eval_messages):
    """A DFlash drafter trained on the tiny target's own replies: some of its blocks are accepted."""
    from services.trainer.train import train_drafter

    data = tmp_path_factory.mktemp("dflash") / "data"
    data.mkdir()
    write_run(data, "dflash", tiny_target, tiny_samples, eval_messages,
              train={**DFLASH_TRAIN, "epochs": 40, "lr": 1e-2, "save_every": 1000})
    result = train_drafter(RunSpec.load(data, "dflash"), data=data, model_dir=tiny_target.model_dir, device="cpu")
    return result.drafter.eval()


@pytest.fixture(scope="session")
def untrained_drafter(tiny_target):
    """A random drafter with the tiny target's embedding and an identity draft vocabulary of 256."""
    from modeling.eagle3 import DrafterConfig, Eagle3Drafter
    from modeling.target_head import load_target_head, read_target_config

    torch.manual_seed(1)
    config = DrafterConfig.from_target_config(read_target_config(tiny_target.model_dir), draft_vocab_size=256, layer_ids=LAYER_IDS)
    drafter = Eagle3Drafter(config)
    drafter.load_embedding(load_target_head(tiny_target.model_dir).embed)
    drafter.set_vocab_mapping(torch.arange(256), torch.arange(config.vocab_size) < 256)
    return drafter.eval()
