"""Sample dumps: the samples of a step as JSON lines, one file per step, for reading what was trained.

    RUN_DIR/rollouts/step_000012.jsonl      the samples trained at step 12 (`rollout.dump: true`)
    RUN_DIR/rollouts/step_000013.jsonl.gz   gzip when the text is over 1 MiB
    RUN_DIR/eval/<name>/step_000010.jsonl   evaluation samples, same records

A record (`sample_record`) is one sample: the caller's fields (`step`, `index`, ...), then
`group_id`, `task` (its `rollout.tasks` entry, `moe_rl.tasks.mixture`; None outside a mixture),
`prompt_text` / `response_text` (decoded), `prompt_ids` / `response_ids`, `answer`,
`reward`, `advantage` (its group advantage as trained; None outside training), `loss_mask_tokens`
and `response_tokens`, `versions` = the response's weight versions as ranges
`[[first_token, last_token_exclusive, version], ...]` (a None run = environment tokens: tool
results, user turns, template glue), `trainer_version`, `staleness` (trainer version minus the
oldest token version, as the batch counts it), `status` (completed | truncated | aborted),
`segments` (engine requests behind it; > 1 = continued across a weight swap) and, for agent
episodes, `episode` = {index, sequence, sequences, turns, tool_calls (a count), calls (each
parsed call: turn, name, arguments), metrics (the agent's own, `Episode.metrics`)} as
`moe_rl.agents.episode` records them (None for single-turn samples). A trained sample's record also
has `expert_load`: per MoE layer, the routed slots each expert got over the sample's tokens
(`moe_rl.rollout.expert_load.MoELayers.sample_counts`), or None without routing or where MoE layers x
experts is over `expert_load.DUMP_MAX_VALUES` (more numbers than the sample's text).

Files are written under a temporary name and renamed, so a reader or a crash never sees half a
file. A resumed run redoes the steps after its checkpoint, so `remove_after(step)` drops their files
first (`moe_rl.jobs.rl`); each step then has exactly one file.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_rl.agents.chat import load_tokenizer
from moe_rl.rollout.buffer import staleness
from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.expert_load import MoELayers
from moe_rl.rollout.train_batch import BatchInfo
from moe_rl.sample import Sample

ROLLOUTS_DIR = "rollouts"
EVAL_DIR = "eval"
GZIP_ABOVE_BYTES = 1 << 20
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl(\.gz)?")

Decode = Callable[[list[int]], str]


def sample_record(
    sample: Sample, *, decode: Decode, advantage: float | None, trainer_version: int | None, **extra
) -> dict[str, Any]:
    """The JSON-safe record of `sample` (fields in the module docstring); `extra` fields come first
    and win over computed ones of the same name."""
    meta = sample.metadata
    fields = {
        "group_id": sample.group_id,
        "task": meta.get("task"),
        "prompt_text": decode(sample.prompt_ids),
        "response_text": decode(sample.response_ids),
        "prompt_ids": list(sample.prompt_ids),
        "response_ids": list(sample.response_ids),
        "answer": meta.get("answer"),
        "reward": sample.reward,
        "advantage": advantage,
        "loss_mask_tokens": sum(sample.loss_mask),
        "response_tokens": len(sample.response_ids),
        "versions": version_ranges(sample.weight_versions),
        "trainer_version": trainer_version,
        "staleness": None if trainer_version is None else staleness(sample, trainer_version),
        "status": sample.status,
        "segments": sample.segments,
        "episode": _episode(meta),
    }
    record = {**extra, **fields}
    record.update(extra)
    return record


def version_ranges(versions: list[int | None]) -> list[list]:
    """Per-token versions as runs `[first, last_exclusive, version]`; None (environment) runs too."""
    ranges: list[list] = []
    for i, version in enumerate(versions):
        if ranges and ranges[-1][2] == version:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1, version])
    return ranges


def trained_records(
    step: int,
    groups: list[list[Sample]],
    info: BatchInfo,
    *,
    decode: Decode,
    trainer_version: int,
    moe: MoELayers | None = None,
) -> list[dict[str, Any]]:
    """The records of the samples trained at `step`, as `build_batch` made `info` of `groups`
    at `trainer_version` (its advantages are in the same sample order); `moe`: the model's MoE
    layers, for each record's `expert_load`."""
    samples = [(index, sample) for group in groups for index, sample in enumerate(group)]
    assert len(info.advantages) == len(samples), "info is not the BatchInfo of these groups"
    return [
        sample_record(
            sample,
            decode=decode,
            advantage=advantage,
            trainer_version=trainer_version,
            step=step,
            index=i,
            expert_load=moe.sample_counts(sample.routed_experts) if moe else None,
        )
        for (i, sample), advantage in zip(samples, info.advantages)
    ]


def run_decoder(rollout: RolloutConfig, tokenizer_dir: str | None) -> Decode:
    """Token ids -> text for a run's dumps (`text_decoder`, falling back on the rollout task's)."""
    return text_decoder(tokenizer_dir, lambda: rollout.make_task(tokenizer_dir).decode)


def text_decoder(tokenizer_dir: str | None, fallback: Callable[[], Decode]) -> Decode:
    """Token ids -> text for dumps: the model's tokenizer with special tokens kept (chat turns stay
    visible) when there is one, else `fallback()` (a task's own `decode`)."""
    if tokenizer_dir is not None:
        try:
            tokenizer = load_tokenizer(tokenizer_dir)
        except ValueError:  # model.path without tokenizer files: the task decodes
            pass
        else:
            return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    return fallback()


class SampleDump:
    """One directory of per-step record files; a single writer at a time."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def write(self, step: int, records: list[dict[str, Any]]) -> Path:
        """Write `step`'s records atomically (temp name + rename), gzip when over 1 MiB; replaces
        the step's earlier file in either form."""
        data = "".join(json.dumps(r, default=str) + "\n" for r in records).encode()
        name = f"step_{step:06d}.jsonl"
        if len(data) > GZIP_ABOVE_BYTES:
            name, data = name + ".gz", gzip.compress(data)
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / name
        temp = self.directory / f".{name}.{os.getpid()}.tmp"
        try:
            temp.write_bytes(data)
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        for path in self._files(step):
            if path != final:
                path.unlink()
        return final

    def read(self, step: int) -> list[dict[str, Any]]:
        files = self._files(step)
        if not files:
            raise ValueError(f"no step {step} in {self.directory}: steps there are {describe_steps(self.steps())}")
        raw = files[0].read_bytes()
        text = (gzip.decompress(raw) if files[0].name.endswith(".gz") else raw).decode()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def steps(self) -> list[int]:
        return sorted({step for step, _ in self._all()})

    def remove_after(self, step: int) -> None:
        """Drop the files of steps after `step` and any temp file (a resumed run redoes those steps)."""
        for later, path in self._all():
            if later > step:
                path.unlink()
        for temp in self.directory.glob(".step_*.tmp"):
            temp.unlink(missing_ok=True)

    def _all(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        found = [(_STEP_FILE.fullmatch(p.name), p) for p in self.directory.iterdir()]
        return [(int(match.group(1)), path) for match, path in found if match]

    def _files(self, step: int) -> list[Path]:
        return [path for s, path in self._all() if s == step]


def describe_steps(steps: list[int]) -> str:
    """'1..12' for a contiguous run, else the steps (the first and last few of a long list)."""
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}..{steps[-1]}"
    if len(steps) > 10:
        return ", ".join(map(str, steps[:5])) + ", ..., " + ", ".join(map(str, steps[-3:]))
    return ", ".join(map(str, steps))


def _episode(meta: dict[str, Any]) -> dict[str, Any] | None:
    if "turns" not in meta:  # set by `Episode.samples()`
        return None
    return {
        "index": meta.get("episode"),
        "sequence": meta.get("sequence"),
        "sequences": meta.get("sequences"),
        "turns": meta["turns"],
        "tool_calls": meta.get("tool_calls", 0),
        "calls": meta.get("calls", []),
        "metrics": meta.get("metrics", {}),
    }


class RolloutDump:
    """The RL driver's `rollout.dump: true`: each trained step's records in RUN_DIR/rollouts/."""

    def __init__(self, run_dir: str | Path, decode: Decode):
        self.dump, self.decode = SampleDump(Path(run_dir) / ROLLOUTS_DIR), decode

    def write(self, step: int, groups: list[list[Sample]], info: BatchInfo, trainer_version: int) -> Path:
        return self.dump.write(
            step, trained_records(step, groups, info, decode=self.decode, trainer_version=trainer_version)
        )
