"""Refusal before start: every check an actor would make on its inputs, run in the driver first.

A config is validated in two stages. Building `RunConfig` checks each field and the fields
against each other (`moe_rl.config`). `check_run` then checks the inputs the processes would
open, in the driver, before Ray or any process starts, so a mistake costs seconds and reads as
one line naming the field and the fix (the CLI prints it and exits 2) instead of a traceback
from inside a Ray actor minutes later:

1. the model: an HF `model.path` holds its weights (safetensors), the tokenizer directory loads;
2. packed sequences and context parallelism run where the trainer will be: on GPUs (Transformer
   Engine here, or a `cluster:` section) `trainer.pack_sequences` and `trainer.cp` > 1 need
   `trainer.precision: bf16`;
3. the weight-sync transport has what it needs (`sync.disk_dir` for `disk`), and the engines can
   apply `sync.delta` (the embedded engine; SGLang 0.5.23 cannot);
4. the task (each task of a mixture, `rollout.tasks`): a user's `package.module:Class` imports
   and is a `Task` subclass, its options are ones it takes, its dataset's files, keys and rows are
   valid (`moe_rl.tasks.dataset`), its reward (`rollout.reward`) and agent import and are
   functions of the right kind, the chat template exists where prompts or agents need it, an
   agent's task gives chat messages that render within the episode's context, and prompts +
   `max_new_tokens` (or an episode's context), or a supervised run's `data.seq_length`, fit the
   model's positions (with YaRN, factor x original_max_position_embeddings);
5. every eval dataset, the same way;
6. the engines can run here (`engines.kind: sglang` needs GPUs);
6b. `algorithm.distill`'s teachers share the student's vocabulary (`moe_rl.signals.teacher.check_vocabulary`);
7. a token budget per micro-batch (`trainer.max_tokens_per_microbatch`) holds the longest
   sequence a step can carry (the probed prompts + `max_new_tokens`, an episode's context, or
   `data.seq_length` for a supervised run).

Each check is one function below; `check_run` runs them in this order and `check_eval` the
parts that `moe-rl eval` needs.
"""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path

from moe_rl.agents import ChatFormat
from moe_rl.config import ModelConfig, RunConfig
from moe_rl.conversion.directory import is_converted
from moe_rl.signals.teacher import check_vocabulary
from moe_rl.tasks import Task, get_reward
from moe_rl.tasks.registry import resolve_agent, task_class
from parallel.bridges.rope import max_positions, yarn
from parallel.hf_checkpoint import HFCheckpointReader
from parallel.model import use_transformer_engine

FIELDS = ("rollout.", "model.", "eval.")
"""How a message that already names its config field begins."""

CONTEXT_PROBE_PROMPTS = 256
"""Prompts looked at to bound the prompt length (tasks may be endless)."""


def check_run(config: RunConfig) -> None:
    """Everything `moe-rl train` would find wrong once its processes run (ValueError)."""
    check_model(config.model)
    check_packing(config)
    if not config.is_rl:
        check_sequence_positions(config)
        check_token_budget(config, config.data.seq_length, "data.seq_length")
        if config.eval is not None:
            raise ValueError(
                "eval: a supervised run (no rollout section) is not evaluated; add a rollout section, "
                "or evaluate a checkpoint with `moe-rl eval CONFIG --checkpoint DIR`"
            )
        return
    check_sync(config)
    rollout = config.rollout
    longest = 0
    for field, spec in rollout.task_configs():  # the task, or each task of a mixture
        if rollout.environment is None:
            check_task_options(spec.task, spec.task_options, field)
        try:
            task = spec.make_task(config.model.tokenizer_dir)
        except ValueError as error:  # a built-in task's own option check names only the option
            message = str(error)
            raise ValueError(message if message.startswith(FIELDS) else f"{field}.task_options: {message}") from None
        except Exception as error:  # a user's task class failed in its constructor
            raise ValueError(
                f"{field}.task={spec.task!r}: building it with {field}.task_options raised "
                f"{type(error).__name__}: {error}; fix the options or the class"
            ) from error
        if spec.reward and spec.reward != "judge":  # a judge's config is checked where it is built
            get_reward(spec.reward, f"{field}.reward")
        longest = max(longest, check_prompts(config, task, rollout.agent, rollout.max_new_tokens, "rollout"))
    check_eval(config)
    check_engines(config)
    if config.algorithm.distill is not None:
        for key, served in config.algorithm.distill.served().items():
            field = "algorithm.distill.teacher" if key is None else f"algorithm.distill.teachers.{key}"
            check_vocabulary(config.model, served, field)
    if rollout.agent is None and task.agent is None:
        check_token_budget(config, longest, f"the task's prompts + rollout.max_new_tokens={rollout.max_new_tokens}")
    else:
        check_token_budget(config, longest, "rollout.episode.max_context_tokens")


def check_eval(config: RunConfig) -> None:
    """Every eval dataset builds (files, keys, rows, reward, agent) and fits the model's context."""
    if config.eval is None:
        return
    rollout = config.rollout_or_default
    for dataset in config.eval.datasets:
        resolved = dataset.resolved(rollout)
        if resolved.task is not None:
            check_task_options(resolved.task, resolved.task_options, dataset.field)
        task = resolved.make_task(config.model.tokenizer_dir)
        if resolved.reward == "judge":
            raise ValueError(
                f"{dataset.field}.reward='judge': the served judge scores training rollouts only; "
                "give the eval dataset a rule reward (e.g. math)"
            )
        if resolved.reward:
            get_reward(resolved.reward, f"{dataset.field}.reward")
        check_prompts(config, task, resolved.agent, resolved.max_new_tokens, dataset.field)


def check_model(model: ModelConfig) -> None:
    """An HF `model.path` holds readable safetensors weights (converted checkpoints are checked by
    `ModelConfig`); the tokenizer directory, when set, holds a tokenizer."""
    if model.path is not None and not is_converted(model.path):
        try:
            HFCheckpointReader(model.path)
        except ValueError as error:
            hint = ""
            if Path(model.path).name == "hf_files":
                hint = " (this is the side-files folder of a converted checkpoint: point model.path at its parent)"
            raise ValueError(
                f"model.path={model.path!r} has config.json but no usable weights{hint}: {error}"
            ) from None


def check_sync(config: RunConfig) -> None:
    """The weight-sync transport's required fields (the sender would fail on them after start-up),
    and engines that can apply `sync.delta` (`moe-rl plan` still models a delta for any config)."""
    if config.sync.transport == "disk" and not config.sync.disk_dir and config.lora is None:
        raise ValueError(
            "sync.transport='disk' needs sync.disk_dir: a directory that the trainer writes and every "
            "engine reads (shared storage on a cluster); set it, or use sync.transport: broadcast"
        )
    if config.sync.delta.enabled and config.engines.kind == "sglang" and config.sync.transport != "cuda_ipc":
        raise ValueError(
            f"sync.delta.enabled with engines.kind='sglang' and sync.transport={config.sync.transport!r}: SGLang "
            "0.5.23 runs a custom loader (the delta loader) only on /update_weights_from_tensor, the cuda_ipc "
            "transport's route; set sync.transport: cuda_ipc (rl.colocate: true, one engine), or "
            "sync.delta.enabled: false (docs/delta-sync.md)"
        )


def check_task_options(name: str, options: dict, section: str) -> None:
    """The task (`{section}.task`) resolves, and every option is a keyword its constructor takes
    (a CLI override of the task keeps the config's options, which may belong to another task)."""
    field = f"{section}.task_options"
    parameters = inspect.signature(task_class(name, f"{section}.task")).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        takes = sorted(n for n in parameters if n not in ("self",)) or "no options"
        raise ValueError(
            f"{field} has {unknown[0]!r}, which task {name!r} does not take (it takes {takes}): remove it from {field}"
        )


def check_prompts(config: RunConfig, task: Task, agent: str | None, max_new_tokens: int, field: str) -> int:
    """Single-turn: the longest of the first prompts + `max_new_tokens` fits the model's context.
    Agents: the agent imports, the tokenizer has a chat template, the task gives chat messages and
    an episode's context fits. Returns the longest sequence a sample can be (tokens)."""
    limit, covered_by = model_positions(config.model.load_hf_config().get_text_config())
    prompts = list(itertools.islice(task.prompts(0), CONTEXT_PROBE_PROMPTS))
    if agent is None and task.agent is None:
        longest = max((len(p.prompt_ids) for p in prompts), default=0)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"{field}.max_new_tokens={max_new_tokens} + the task's prompts (up to {longest} tokens) exceed "
                f"the model's positions ({covered_by}): lower {field}.max_new_tokens to at most "
                f"{limit - longest}{LONGER}"
            )
        return longest + max_new_tokens
    if agent is not None:
        resolve_agent(agent, f"{field}.agent")
    rollout = config.rollout_or_default
    if config.model.tokenizer_dir is None:
        raise ValueError(f"{field}.agent needs a tokenizer with a chat template: set model.tokenizer (or model.path)")
    try:
        episode = rollout.episode
        chat = ChatFormat.load(
            config.model.tokenizer_dir, episode.tool_call_format, episode.reasoning_parser, episode.chat_template_kwargs
        )
    except ValueError as error:
        raise ValueError(f"model.tokenizer={config.model.tokenizer_dir!r} for {field}.agent: {error}") from None
    if not prompts or not all(p.messages for p in prompts):
        raise ValueError(
            f"{field}.agent: the task ({field}.task) gives token prompts; agents need chat messages "
            "(Prompt(messages=[...], tools=[...]))"
        )
    context = rollout.episode.max_context_tokens
    if limit is not None and context > limit:
        raise ValueError(
            f"rollout.episode.max_context_tokens={context} exceeds the model's positions ({covered_by}): "
            f"lower it to at most {limit}{LONGER}"
        )
    longest = max(len(rendered(chat, p, field)) for p in prompts)
    if longest >= context:
        raise ValueError(
            f"{field}: the task's chat prompts render to up to {longest} tokens with the chat template, which "
            f"leaves no room for a turn in rollout.episode.max_context_tokens={context}: raise it (up to the "
            "model's max_position_embeddings), or shorten the prompts"
        )
    return context


LONGER = (
    ", or give the model YaRN rope scaling (rope_parameters: rope_type yarn, factor, original_max_position_embeddings "
    "in its HF config) for factor x original positions"
)
"""The fix for a sequence longer than the model's positions, beside shortening it."""


def model_positions(hf) -> tuple[int | None, str]:
    """The longest sequence the model's positions cover (None: its config names no limit), and what
    sets it, for messages: max_position_embeddings, or YaRN's factor x original_max_position_embeddings
    where that is more (`parallel.bridges.rope.max_positions`)."""
    limit, scaled = max_positions(hf), yarn(hf)
    if scaled is not None and limit == scaled.scaled_positions:
        original = scaled.original_max_position_embeddings
        return limit, f"YaRN factor {scaled.factor:g} x original_max_position_embeddings {original} = {limit}"
    return limit, f"max_position_embeddings {limit}"


def check_sequence_positions(config: RunConfig) -> None:
    """A supervised run's data.seq_length fits the model's positions."""
    limit, covered_by = model_positions(config.model.load_hf_config().get_text_config())
    if limit is not None and config.data.seq_length > limit:
        raise ValueError(
            f"data.seq_length={config.data.seq_length} exceeds the model's positions ({covered_by}): lower "
            f"data.seq_length to at most {limit}{LONGER}"
        )


def rendered(chat: ChatFormat, prompt, field: str) -> list[int]:
    """The ids of an agent prompt's first turn (its messages and tools through the chat template)."""
    try:
        return chat.prompt_ids(prompt.messages, prompt.tools)
    except Exception as error:  # jinja's own errors (a template that refuses these messages)
        raise ValueError(
            f"{field}: the chat template cannot render a prompt of the task ({type(error).__name__}: {error}); "
            f"first message: {prompt.messages[0]!r}"
        ) from error


def check_token_budget(config: RunConfig, longest: int, source: str) -> None:
    """trainer.max_tokens_per_microbatch holds the longest sequence (`longest` tokens, from
    `source`): a micro-batch holds at least one whole sequence, padded to the trainer's sequence
    multiple (2 x cp chunks, each split over TP under sequence parallel)."""
    budget = config.trainer.max_tokens_per_microbatch
    if budget is None:
        return
    multiple = config.trainer.sequence_multiple
    needed = longest + (-(longest - 1)) % multiple  # microbatches.padded_length (no torch import here)
    if budget < needed:
        raise ValueError(
            f"trainer.max_tokens_per_microbatch={budget} is below the longest sequence a step can carry: "
            f"{needed} tokens ({source}, padded to a multiple of {multiple} for context and sequence parallel): raise "
            f"trainer.max_tokens_per_microbatch to at least {needed}, or set it to null"
        )


def check_packing(config: RunConfig) -> None:
    """trainer.pack_sequences and trainer.cp > 1 in fp32 are refused where the trainer runs Transformer
    Engine's attention on GPUs (`TrainerConfig.check_packing_precision`,
    `TrainerConfig.check_context_parallel_precision`): TE installed here, or a `cluster:` section."""
    gpu_te = config.cluster is not None or use_transformer_engine()
    config.trainer.check_packing_precision(gpu_te=gpu_te)
    config.trainer.check_context_parallel_precision(gpu_te=gpu_te)


def check_engines(config: RunConfig) -> None:
    """The engines can start on this machine."""
    # heavy: torch, only to ask for GPUs
    import torch

    if config.engines.kind == "sglang" and not torch.cuda.is_available():
        raise ValueError(
            "engines.kind='sglang' needs GPUs; use engines.kind: embedded on CPU "
            "(`moe-rl plan` checks GPU configs on any machine)"
        )
