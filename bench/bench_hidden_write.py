"""Hidden-state file writing: ``safetensors.save`` + an atomic write of its bytes (the plain way) against
``shared.hidden_write`` (header, then each tensor's own memory, checksum on the way out), same files,
same directory, each fsync'd and renamed.

    python bench/bench_hidden_write.py --dir /data/bench-write --tokens 2048 --hidden 4096 --files 16

Reports MB/s per writer and the directory's own sustained rate (``dd``-like: one large buffer written and
fsync'd), which bounds both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save  # noqa: E402

from shared.atomic import atomic_write, atomic_write_bytes  # noqa: E402
from shared.hidden_write import RawTensor, write_safetensors  # noqa: E402
from shared.settings import configure_logging  # noqa: E402

log = logging.getLogger("bench_hidden_write")


def sample(tokens: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 32000, (tokens,), generator=gen),
            "loss_mask": torch.ones(tokens, dtype=torch.uint8),
            "aux_hidden_states": torch.randn(tokens, 3 * hidden, generator=gen).to(torch.bfloat16),
            "last_hidden_state": torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)}


def plain(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    data = save(tensors, metadata={"bench": "1"})
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest(), len(data)


def direct(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    names = {torch.bfloat16: "BF16", torch.int64: "I64", torch.uint8: "U8"}
    raw = {n: RawTensor.of(t.contiguous().view(torch.uint8).numpy(), dtype=names[t.dtype], shape=tuple(t.shape))
           for n, t in tensors.items()}
    written = write_safetensors(path, raw, {"bench": "1"})
    return written.sha256, written.nbytes


def disk_rate(directory: Path, nbytes: int) -> float:
    buffer = os.urandom(1 << 20) * max(1, nbytes >> 20)
    started = time.perf_counter()
    atomic_write(directory / "dd.bin", lambda handle: handle.write(buffer))
    seconds = time.perf_counter() - started
    (directory / "dd.bin").unlink()
    return len(buffer) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    configure_logging()
    args.dir.mkdir(parents=True, exist_ok=True)
    samples = [sample(args.tokens, args.hidden, i) for i in range(args.files)]
    result: dict = {"tokens": args.tokens, "hidden": args.hidden, "files": args.files, "rounds": []}
    for round_ in range(args.rounds):  # alternate, so page-cache state favours neither
        row = {}
        for name, writer in (("safetensors_save", plain), ("direct", direct)):
            out = args.dir / name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            started, total, digests = time.perf_counter(), 0, []
            for i, tensors in enumerate(samples):
                digest, nbytes = writer(out / f"{i}.safetensors", tensors)
                total, digests = total + nbytes, digests + [digest]
            row[f"{name}_mb_per_s"] = total / (time.perf_counter() - started) / 1e6
            row[f"{name}_digests"] = digests
        same = row.pop("safetensors_save_digests") == row.pop("direct_digests")
        row["same_bytes"] = same  # the two layouts may differ in header spacing; both must read back
        row["disk_mb_per_s"] = disk_rate(args.dir, total) / 1e6
        log.info("round %d: %s", round_, json.dumps(row))
        result["rounds"].append(row)
    shutil.rmtree(args.dir / "safetensors_save", ignore_errors=True)
    shutil.rmtree(args.dir / "direct", ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
