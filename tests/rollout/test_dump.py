"""Sample dumps (moe_rl.rollout.dump) and `moe-rl samples`: hand-built Samples, no processes."""

from __future__ import annotations

import gzip
import json

import pytest

from moe_rl import cli
from moe_rl.algorithms import AlgorithmConfig
from moe_rl.rollout.dump import SampleDump, run_decoder, sample_record, trained_records, version_ranges
from moe_rl.rollout.train_batch import build_batch
from moe_rl.sample import Sample


def decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def sample(gid: str, reward: float, versions: list[int | None], **metadata) -> Sample:
    n = len(versions)
    return Sample(
        prompt_ids=[1, 2, 3],
        response_ids=list(range(10, 10 + n)),
        rollout_logprobs=[-0.1] * n,
        loss_mask=[0 if v is None else 1 for v in versions],
        weight_versions=versions,
        reward=reward,
        group_id=gid,
        status="truncated",
        segments=2,
        metadata={"answer": "42", **metadata},
    )


def test_version_ranges_keep_environment_runs_and_a_switch_mid_response():
    assert version_ranges([]) == []
    assert version_ranges([3, 3, 3]) == [[0, 3, 3]]
    assert version_ranges([3, 3, 4, 4, 4]) == [[0, 2, 3], [2, 5, 4]]  # continued under new weights
    assert version_ranges([2, None, None, 2, 3, None]) == [[0, 1, 2], [1, 3, None], [3, 4, 2], [4, 5, 3], [5, 6, None]]


def test_record_of_a_single_turn_sample():
    record = sample_record(
        sample("g7", 0.5, [3, 3, 4], task="math"), decode=decode, advantage=-0.25, trainer_version=5, step=6, index=1
    )
    assert list(record)[:2] == ["step", "index"]  # the caller's fields first
    assert record == {
        "step": 6,
        "index": 1,
        "group_id": "g7",
        "task": "math",
        "prompt_text": "t1 t2 t3",
        "response_text": "t10 t11 t12",
        "prompt_ids": [1, 2, 3],
        "response_ids": [10, 11, 12],
        "answer": "42",
        "reward": 0.5,
        "advantage": -0.25,
        "loss_mask_tokens": 3,
        "response_tokens": 3,
        "versions": [[0, 2, 3], [2, 3, 4]],
        "trainer_version": 5,
        "staleness": 2,
        "status": "truncated",
        "segments": 2,
        "episode": None,
    }
    assert json.loads(json.dumps(record)) == record
    outside = sample_record(sample("g", 1.0, [0]), decode=decode, advantage=None, trainer_version=None, reward=9)
    assert outside["staleness"] is None and outside["advantage"] is None and outside["reward"] == 9
    assert outside["task"] is None  # outside a mixture


def test_record_of_an_episode_keeps_turns_tool_calls_and_environment_runs():
    calls = [{"turn": 1, "name": "lookup", "arguments": {"key": "C"}}]
    skills = {"right_key": 1.0}
    facts = dict(episode=1, sequence=0, sequences=1, turns=2, tool_calls=1, calls=calls, metrics=skills)
    episode = sample("g1", 1.0, [2, 2, None, None, 3], **facts)
    record = sample_record(episode, decode=decode, advantage=0.7, trainer_version=3)
    expected = {"index": 1, "sequence": 0, "sequences": 1, "turns": 2, "tool_calls": 1, "calls": calls}
    expected["metrics"] = skills
    assert record["episode"] == expected
    assert record["versions"] == [[0, 2, 2], [2, 4, None], [4, 5, 3]]
    assert record["loss_mask_tokens"] == 3 and record["response_tokens"] == 5
    assert record["staleness"] == 1


def test_trained_records_carry_the_advantages_build_batch_trained_with():
    groups = [[sample("a", 1.0, [2, 2]), sample("a", 0.0, [2])], [sample("b", 0.5, [1]), sample("b", 0.5, [2, 2])]]
    batch, info = build_batch(groups, AlgorithmConfig(), version=3)
    records = trained_records(4, groups, info, decode=decode, trainer_version=3)
    assert [(r["step"], r["group_id"], r["index"]) for r in records] == [
        (4, "a", 0),
        (4, "a", 1),
        (4, "b", 0),
        (4, "b", 1),
    ]
    for row, record in enumerate(records):
        n = record["response_tokens"]
        assert batch.advantages[row, 3 : 3 + n].tolist() == [pytest.approx(record["advantage"])] * n
    assert records[0]["advantage"] > 0 > records[1]["advantage"] and records[2]["advantage"] == 0.0
    assert [r["staleness"] for r in records] == info.staleness == [1, 1, 2, 1]


def test_write_read_back_atomically_and_gzip_when_large(tmp_path):
    dump = SampleDump(tmp_path / "rollouts")
    assert dump.steps() == []
    records = [sample_record(sample("g", 1.0, [0, 1]), decode=decode, advantage=0.0, trainer_version=1, step=12)]
    path = dump.write(12, records)
    assert path.name == "step_000012.jsonl" and dump.read(12) == records
    assert [p.name for p in dump.directory.iterdir()] == ["step_000012.jsonl"]  # no temp file left

    large = [{"step": 13, "response_text": "x" * 4096, "i": i} for i in range(300)]  # ~1.2 MiB of text
    path = dump.write(13, large)
    assert path.name == "step_000013.jsonl.gz" and dump.read(13) == large
    assert gzip.decompress(path.read_bytes()).decode().count("\n") == 300
    dump.write(13, records)  # a redone step, now small: one file for the step
    assert sorted(p.name for p in dump.directory.iterdir()) == ["step_000012.jsonl", "step_000013.jsonl"]
    assert dump.steps() == [12, 13]
    with pytest.raises(ValueError, match=r"no step 5 in .*: steps there are 12, 13"):
        dump.read(5)


def test_remove_after_drops_later_steps_and_leftover_temp_files(tmp_path):
    dump = SampleDump(tmp_path)
    for step in range(1, 6):
        dump.write(step, [{"step": step}])
    (tmp_path / ".step_000006.jsonl.123.tmp").write_text("half a fi")  # a crash mid-write
    (tmp_path / "notes.txt").write_text("kept")
    dump.remove_after(3)
    assert dump.steps() == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt",
        "step_000001.jsonl",
        "step_000002.jsonl",
        "step_000003.jsonl",
    ]
    SampleDump(tmp_path / "missing").remove_after(0)  # nothing dumped yet: nothing to do


def test_run_decoder_falls_back_to_the_task(tmp_path):
    from moe_rl.rollout.config import RolloutConfig

    copy = RolloutConfig(task="copy_digits")
    assert run_decoder(copy, None)([13, 14]) == copy.make_task().decode([13, 14])
    assert run_decoder(copy, str(tmp_path))([13]) == copy.make_task().decode([13])  # a model dir without tokenizer


# -- moe-rl samples ------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # rich's width off a terminal: short lines unwrapped
    run = tmp_path / "run"
    dump = SampleDump(run / "rollouts")
    for step in (1, 2):
        dump.write(
            step,
            [
                sample_record(
                    sample(f"g{step}", reward, [step - 1, None, step], task="copy" if i % 2 else None),
                    decode=lambda ids, r=reward: f"text of reward {r} " + decode(ids),
                    advantage=reward - 0.5,
                    trainer_version=step,
                    step=step,
                    index=i,
                )
                for i, reward in enumerate([0.5, 0.0, 1.0, 0.25])
            ],
        )
    SampleDump(run / "eval" / "math").write(2, [{"step": 2, "group_id": "e0", "reward": 1.0, "response_text": "EVAL"}])
    return run


def output_of(capsys, argv: list[str]) -> str:
    assert cli.main(["samples", *argv]) == 0
    return capsys.readouterr().out


def error_of(capsys, argv: list[str]) -> str:
    assert cli.main(["samples", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("moe-rl: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_samples_prints_the_newest_step_with_texts_and_numbers(run_dir, capsys):
    out = output_of(capsys, [str(run_dir)])
    assert "step 2: 4 of 4 samples" in out
    assert "text of reward 0.5 t10 t11 t12" in out and "text of reward 0.5 t1 t2 t3" in out
    assert "reward 0.500" in out and "advantage 0.000" in out and "staleness 1" in out
    assert "v1 x1, env x1, v2 x1" in out and "status truncated" in out and "group g2" in out
    assert out.count("task copy") == 2  # a mixture's samples name their task
    assert "step 1:" in output_of(capsys, [str(run_dir), "--step", "1"])


def test_samples_worst_and_best_sort_by_reward_and_limit(run_dir, capsys):
    out = output_of(capsys, [str(run_dir), "--worst", "--limit", "3"])
    shown = [float(line.split("reward ")[1].split()[0]) for line in out.splitlines() if "advantage" in line]
    assert shown == [0.0, 0.25, 0.5] and "3 of 4 samples, worst first" in out
    out = output_of(capsys, [str(run_dir), "--best", "--limit", "2"])
    shown = [float(line.split("reward ")[1].split()[0]) for line in out.splitlines() if "advantage" in line]
    assert shown == [1.0, 0.5]
    assert "EVAL" in output_of(capsys, [str(run_dir), "--eval", "math"])


def test_samples_shortens_long_texts(run_dir, capsys):
    SampleDump(run_dir / "rollouts").write(3, [{"group_id": "x", "reward": 1.0, "response_text": "a" * 5000 + "END"}])
    out = "".join(output_of(capsys, [str(run_dir), "--step", "3"]).replace("│", "").split())  # unwrapped
    assert "[...3903chars]" in out and out.endswith("END╰" + "─" * 298 + "╯") and out.count("a") < 1200


def test_samples_errors_name_the_fix(run_dir, tmp_path, capsys):
    assert "is not a directory" in error_of(capsys, [str(tmp_path / "nope")])
    (tmp_path / "bare").mkdir()
    assert "set rollout.dump: true" in error_of(capsys, [str(tmp_path / "bare")])
    assert "no step 9 in" in error_of(capsys, [str(run_dir), "--step", "9"])
    assert "steps there are 1, 2" in error_of(capsys, [str(run_dir), "--step", "9"])
    assert "evaluations with dumps here: ['math']" in error_of(capsys, [str(run_dir), "--eval", "gsm8k"])
    assert "--limit 0" in error_of(capsys, [str(run_dir), "--limit", "0"])
