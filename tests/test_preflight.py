"""Refusal before start: a table of bad configs, each given to `moe-rl train` (and `moe-rl eval`)
as a user would, in this process. Each must exit 2 with one line that names the field and the
fix, before Ray (or any process) starts: `ray.init` and process starts fail the test here."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from moe_rl import cli
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config, hf_fields, save_random_model

CHAT = "configs/tokenizers/tiny_chat"


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Starting Ray fails the test (process starts already do: tests/conftest.py)."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a config that preflight should refuse")

    monkeypatch.setattr(ray, "init", refuse)


def base_config(tmp_path) -> dict:
    return {
        "model": {"hf_config": hf_fields(QWEN3_MOE_SMALL, max_position_embeddings=64)},
        "trainer": {"world_size": 2, "ep": 2, "micro_batch_size": 4, "global_batch_size": 8},
        "rollout": {"task": "copy_digits", "groups_per_step": 4, "n_samples_per_prompt": 2, "max_new_tokens": 4},
        "rl": {"report": False, "save_hf": False},
        "steps": 2,
        "output_dir": str(tmp_path / "run"),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs the bad configs point at: datasets, a converted checkpoint's `hf_files/`, a tokenizer
    without a chat template."""
    root = tmp_path_factory.mktemp("inputs")
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    (root / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "no_answer.jsonl").write_text(json.dumps({"prompt": "1+1="}) + "\n")
    (root / "data.csv").write_text("prompt,answer\n1+1=,2\n")
    hf_files = root / "converted" / "hf_files"  # what a converted checkpoint keeps beside its weights
    hf_files.mkdir(parents=True)
    (hf_files / "config.json").write_text(json.dumps(hf_fields(QWEN3_MOE_SMALL)))
    plain = root / "plain_tokenizer"
    shutil.copytree(CHAT, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    chat = [{"role": "user", "content": "key A"}]
    tool = {"type": "function", "function": {"name": "lookup"}}
    for name, rows in {
        "chat_and_text.jsonl": [{"prompt": chat, "answer": "1"}, {"prompt": "key B", "answer": "2"}],
        "ids.jsonl": [{"prompt_ids": [5, 6], "answer": "1"}],
        "no_role.jsonl": [{"prompt": chat, "answer": "1"}, {"prompt": [{"content": "x"}], "answer": "2"}],
        "bad_tools.jsonl": [{"prompt": chat, "answer": "1", "tools": [tool, {"type": "function", "function": {}}]}],
    }.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "preflight_user.py").write_text(USER_MODULE)
    return root


USER_MODULE = """
from moe_rl.tasks import Prompt, Task


class Chat(Task):
    def __init__(self, length: int = 1):
        if length > 3:
            raise KeyError(length)
        self.length = length

    def prompts(self, seed):
        while True:
            yield Prompt(messages=[{"role": "user", "content": "x" * self.length}])


async def score(response, answer, sample):
    return 1.0
"""


AGENT = {
    "model.tokenizer": CHAT,
    "rollout.agent": "moe_rl.tasks.lookup:lookup_agent",
    "rollout.episode.max_context_tokens": 64,
}


def heldout(**fields) -> list[dict]:
    return [{"name": "heldout", "task": "copy_digits", "task_options": {"length": 2, "split": "eval"}, **fields}]


BAD = [
    # (overrides of the base config, the field the error names, a fragment of the fix)
    ({"model.path": "/no/such/model", "model.hf_config": None}, "model.path", "config.json"),
    ({"model.path": "{files}/converted/hf_files", "model.hf_config": None}, "model.path", "point model.path at"),
    ({"model.tokenizer": "/no/such/tokenizer"}, "model.tokenizer", "point it at"),
    ({"sync.transport": "disk"}, "sync.disk_dir", "set it"),
    ({"engines.kind": "sglang", "sync.delta.enabled": True}, "sync.transport='broadcast'", "sync.transport: cuda_ipc"),
    (
        {
            "rollout.task_options": {"length": 2},
            "rollout.task": "dataset",
            "rollout.dataset": "{files}/good.jsonl",
            "model.tokenizer": CHAT,
        },
        "rollout.task_options",
        "remove it",
    ),
    ({"rollout.task": "no_such_task"}, "rollout.task", "use one of"),
    ({"rollout.task_options": {"length": 40}}, "rollout.task_options", "use 1..32"),
    (
        {"rollout.task": "dataset", "rollout.dataset": "{files}/missing.jsonl", "model.tokenizer": CHAT},
        "rollout.dataset",
        "no such file",
    ),
    (
        {"rollout.task": "dataset", "rollout.dataset": "{files}/no_answer.jsonl", "model.tokenizer": CHAT},
        "rollout.answer_key",
        "answer",
    ),
    (
        {
            "rollout.task": "dataset",
            "rollout.dataset": "{files}/good.jsonl",
            "rollout.prompt_key": "question",
            "model.tokenizer": CHAT,
        },
        "rollout.prompt_key",
        "columns",
    ),
    (
        {"rollout.task": "dataset", "rollout.dataset": "{files}/data.csv", "model.tokenizer": CHAT},
        "rollout.dataset",
        ".parquet",
    ),
    ({"rollout.task": "dataset", "rollout.dataset": "{files}/good.jsonl"}, "model.tokenizer", "set model.tokenizer"),
    ({"rollout.reward": "no_such_module:score"}, "rollout.reward", "cannot import"),
    ({"rollout.reward": "preflight_user:scor"}, "rollout.reward", "has no 'scor'"),
    ({"rollout.reward": "preflight_user:score"}, "rollout.reward", "give a plain def"),
    ({"rollout.task": "no_such_module:Task"}, "rollout.task", "put the directory that holds it on PYTHONPATH"),
    ({"rollout.task": "preflight_user:score"}, "rollout.task", "not a subclass of moe_rl.tasks.Task"),
    ({"rollout.task": "preflight_user:Chat", "rollout.task_options": {"lenght": 2}}, "rollout.task_options", "remove"),
    ({"rollout.task": "preflight_user:Chat", "rollout.task_options": {"length": 4}}, "rollout.task", "raised KeyError"),
    (
        {"rollout.task": "dataset", "rollout.dataset": "{files}/chat_and_text.jsonl", **AGENT},
        "chat_and_text.jsonl' row 1: 'prompt' (rollout.prompt_key) is text",
        "set rollout.apply_chat_template: true",
    ),
    (
        {"rollout.task": "dataset", "rollout.dataset": "{files}/ids.jsonl", **AGENT},
        "ids.jsonl' row 0: 'prompt_ids' are token ids",
        "chat messages in the rollout.prompt_key column",
    ),
    (
        {"rollout.task": "dataset", "rollout.dataset": "{files}/no_role.jsonl", "model.tokenizer": CHAT},
        "no_role.jsonl' row 1: 'prompt' (rollout.prompt_key) message 0 has no 'role'",
        "a prompt is text or",
    ),
    (
        {"rollout.task": "dataset", "rollout.dataset": "{files}/bad_tools.jsonl", "model.tokenizer": CHAT},
        "bad_tools.jsonl' row 0: 'tools' (rollout.tools_key) tools[1] has no function name",
        "OpenAI function definitions",
    ),
    (
        {"rollout.task": "preflight_user:Chat", **AGENT, "rollout.episode.max_context_tokens": 8},
        "leaves no room for a turn in rollout.episode.max_context_tokens=8",
        "raise it",
    ),
    (
        {"rollout.task": "lookup", "rollout.agent": "no_such_module:agent", "model.tokenizer": CHAT},
        "rollout.agent",
        "cannot import",
    ),
    (
        {
            "rollout.task": "lookup",
            "rollout.agent": "moe_rl.tasks.lookup:lookup_agent",
            "model.tokenizer": "{files}/plain_tokenizer",
            "rollout.episode.max_context_tokens": 64,
        },
        "model.tokenizer",
        "chat_template",
    ),
    ({"rollout.max_new_tokens": 100}, "rollout.max_new_tokens", "lower rollout.max_new_tokens to at most"),
    (  # YaRN covers factor x original positions (256 here), not beyond
        {"model.hf_config.rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "rollout.max_new_tokens": 300},
        "rollout.max_new_tokens",
        "YaRN factor 4 x original_max_position_embeddings 64 = 256",
    ),
    ({"rollout.reward_timeout_s": 0}, "rollout.reward_timeout_s", "> 0"),
    ({"rollout": None, "data.seq_length": 65}, "data.seq_length=65", "lower data.seq_length to at most 64"),
    ({"trainer.max_tokens_per_microbatch": 4}, "trainer.max_tokens_per_microbatch", "raise"),
    (  # on GPUs (a cluster section): Transformer Engine's attention packs only in bf16
        {"cluster": {"nodes": 1}, "trainer.max_tokens_per_microbatch": 64, "trainer.pack_sequences": True},
        "trainer.pack_sequences",
        "trainer.precision: bf16",
    ),
    (  # likewise context parallelism
        {"cluster": {"nodes": 1}, "trainer.cp": 2, "trainer.ep": 1},
        "trainer.cp=2 with trainer.precision='fp32'",
        "trainer.precision: bf16",
    ),
    ({"engines.kind": "sglang"}, "engines.kind", "use engines.kind: embedded"),
    ({"trainer.tpp": 2}, "trainer.tpp", "did you mean"),
    ({"trainer.global_batch_size": 16}, "trainer.global_batch_size", "make them equal"),
    ({"eval.datasets": []}, "eval.datasets", "list at least one"),
    ({"eval.datasets": heldout(num_prompts=4) * 2}, "eval.datasets", "give every dataset its own name"),
    (
        {"eval.datasets": [{"name": "heldout", "path": "{files}/missing.jsonl"}], "model.tokenizer": CHAT},
        "eval.datasets['heldout'].path",
        "no such file",
    ),
    (
        {"eval.datasets": heldout(num_prompts=4, task_options={"lenght": 2})},
        "eval.datasets['heldout'].task_options",
        "remove it",
    ),
    (
        {"eval.datasets": heldout(num_prompts=4, reward="no_such_module:f")},
        "eval.datasets['heldout'].reward",
        "cannot import",
    ),
    (
        {"eval.datasets": heldout(num_prompts=4, max_new_tokens=100)},
        "eval.datasets['heldout'].max_new_tokens",
        "at most",
    ),
    ({"eval.datasets": heldout()}, "eval.datasets['heldout']", "set num_prompts"),
    ({"eval.every": -1, "eval.datasets": heldout(num_prompts=4)}, "eval.every", ">= 0"),
    ({"rollout": None, "eval.datasets": heldout(num_prompts=4)}, "eval", "moe-rl eval"),
]


def write_config(tmp_path, files, overrides: dict) -> str:
    config = base_config(tmp_path)
    for key, value in overrides.items():
        value = json.loads(json.dumps(value).replace("{files}", str(files)))
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def refusal(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-rl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("overrides,field,fix", BAD, ids=[f"{i:02d}-{case[1]}" for i, case in enumerate(BAD)])
def test_bad_config_is_refused_before_start(tmp_path, files, capsys, monkeypatch, overrides, field, fix):
    monkeypatch.syspath_prepend(str(files))  # preflight_user.py
    err = refusal(capsys, ["train", write_config(tmp_path, files, overrides)])
    assert field in err and fix in err, err
    assert not (tmp_path / "run").exists()  # nothing written, nothing started


def test_a_command_line_task_override_names_the_option_of_the_other_task(tmp_path, files, capsys):
    """The issue's case: `rollout.task=dataset` over a config whose task_options are copy_digits'."""
    config = write_config(tmp_path, files, {"rollout.task_options": {"length": 2}, "model.tokenizer": CHAT})
    err = refusal(capsys, ["train", config, "rollout.task=dataset", f"rollout.dataset={files}/good.jsonl"])
    assert "rollout.task_options has 'length'" in err and "remove it" in err


def test_bad_eval_configs_are_refused_by_moe_rl_eval_too(tmp_path, files, capsys):
    model = save_random_model(hf_config(QWEN3_MOE_SMALL), tmp_path / "model")
    capsys.readouterr()  # save_pretrained's progress bar
    config = write_config(tmp_path, files, {"eval.datasets": heldout()})
    assert "set num_prompts" in refusal(capsys, ["eval", config, "--checkpoint", str(model)])
    config = write_config(tmp_path, files, {})
    assert "no eval section" in refusal(capsys, ["eval", config, "--checkpoint", str(model)])
    config = write_config(tmp_path, files, {"eval.datasets": heldout(num_prompts=2)})
    assert "--checkpoint='/no/such'" in refusal(capsys, ["eval", config, "--checkpoint", "/no/such"])


def test_yarn_positions_are_accepted_up_to_factor_x_original(tmp_path, files):
    """max_position_embeddings 64 with YaRN factor 4: prompts + max_new_tokens up to 256 pass
    preflight, up to 64 without it."""
    from moe_rl.config import load_config
    from moe_rl.jobs.preflight import check_run

    yarn = {"model.hf_config.rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    check_run(load_config(write_config(tmp_path, files, {**yarn, "rollout.max_new_tokens": 200})))
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        check_run(load_config(write_config(tmp_path, files, {"rollout.max_new_tokens": 200})))


def test_the_token_budget_holds_a_sequence_padded_to_two_cp_chunks(tmp_path, files):
    """Under context parallelism a sequence is padded so that its model input splits into 2 x cp
    chunks: a budget of exactly the longest sequence holds it at cp 1, not at cp 2."""
    from moe_rl.config import load_config
    from moe_rl.jobs.preflight import check_token_budget

    budget = {"trainer.max_tokens_per_microbatch": 10}
    check_token_budget(load_config(write_config(tmp_path, files, budget)), 10, "data.seq_length")
    cp2 = load_config(write_config(tmp_path, files, {**budget, "trainer.cp": 2}))
    with pytest.raises(ValueError, match=r"13 tokens \(data.seq_length, padded to a multiple of 4 .* at least 13"):
        check_token_budget(cp2, 10, "data.seq_length")  # model input 12 = 3 per chunk
