"""Trace files: the Mooncake JSONL and Azure 2023 CSV formats, read into TraceRecords, and
Mooncake prompts rebuilt from `hash_ids` so the trace's prefix sharing is reproduced."""
from __future__ import annotations

import csv
import itertools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from splitserve.bench.errors import BenchSetupError
from splitserve.bench.tokens import TokenSynth

MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in the Mooncake release
DEFAULT_FILES = {"mooncake": "mooncake_conversation.jsonl", "azure": "azure2023_conv.csv"}
DEFAULT_JITTER_S = {"mooncake": 3.0, "azure": 0.0}  # the formats' timestamp granularity


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One traced request: arrival (seconds from the trace start), lengths, and the chained
    prefix-block ids of its prompt (Mooncake only; empty for Azure)."""
    timestamp_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def default_trace_path(kind: str) -> Path:
    """`../shared/data/traces/<file>` next to the repository (or the working directory)."""
    name = DEFAULT_FILES[kind]
    repo = Path(__file__).resolve().parents[2]
    for base in (repo.parent, Path.cwd().parent):
        path = base / "shared" / "data" / "traces" / name
        if path.exists():
            return path
    return repo.parent / "shared" / "data" / "traces" / name


def read_trace(kind: str, path: str | Path | None, limit: int | None) -> list[TraceRecord]:
    """The first `limit` records (all when None) of a `mooncake` or `azure` trace file."""
    file = Path(path) if path is not None else default_trace_path(kind)
    if not file.is_file():
        raise BenchSetupError(f"trace file {file} not found; pass --trace PATH")
    with open(file, encoding="utf-8", newline="") as f:
        records = read_mooncake(f, limit) if kind == "mooncake" else read_azure(f, limit)
    if not records:
        raise BenchSetupError(f"trace file {file} holds no requests")
    return records


def read_mooncake(lines: Iterable[str], limit: int | None = None) -> list[TraceRecord]:
    """Parses JSONL lines: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`
    (`ceil(input_length / 512)` chained block ids)."""
    records: list[TraceRecord] = []
    for num, line in enumerate(lines, 1):
        if limit is not None and len(records) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            rec = TraceRecord(float(obj["timestamp"]) / 1000.0, int(obj["input_length"]),
                              int(obj["output_length"]), tuple(int(h) for h in obj["hash_ids"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise BenchSetupError(f"mooncake trace line {num}: {exc!r}; expected "
                                  "timestamp, input_length, output_length, hash_ids") from exc
        if len(rec.hash_ids) != math.ceil(rec.input_len / MOONCAKE_BLOCK_SIZE):
            raise BenchSetupError(f"mooncake trace line {num}: {len(rec.hash_ids)} hash_ids "
                                  f"for {rec.input_len} tokens (blocks of {MOONCAKE_BLOCK_SIZE})")
        records.append(rec)
    return records


def read_azure(lines: Iterable[str], limit: int | None = None) -> list[TraceRecord]:
    """Parses CSV rows with a header: `arrived_at` (s), `num_prefill_tokens`,
    `num_decode_tokens`."""
    reader = csv.DictReader(lines)
    records = []
    for row in itertools.islice(reader, limit):
        try:
            records.append(TraceRecord(float(row["arrived_at"]), int(row["num_prefill_tokens"]),
                                       int(row["num_decode_tokens"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise BenchSetupError(f"azure trace row {reader.line_num}: {exc!r}; expected "
                                  "arrived_at, num_prefill_tokens, num_decode_tokens") from exc
    return records


def scaled_block_size(length_scale: float) -> int:
    """Tokens per hash id after length scaling: the block shrinks with the lengths, so a
    scaled prompt still has one block per hash id (rounded up so the blocks cover it)."""
    return max(1, math.ceil(MOONCAKE_BLOCK_SIZE * length_scale))


def prompt_from_hash_ids(hash_ids: tuple[int, ...], length: int, block_size: int,
                         synth: TokenSynth, index: int) -> list[int]:
    """Block i of the prompt = `synth.block(hash_ids[i])`, cut to `length` tokens.

    Two prompts sharing their first k hash ids share exactly their first k*block_size
    tokens (the trace's chained hashes make a shared id imply a shared prefix). Should the
    blocks not cover `length` (rounding), the rest is fresh tokens of this request.
    """
    tokens: list[int] = []
    for hash_id in hash_ids:
        if len(tokens) >= length:
            break
        tokens.extend(synth.block(hash_id, block_size))
    if len(tokens) < length:
        tokens.extend(synth.request(index, length - len(tokens)))
    return tokens[:length]
