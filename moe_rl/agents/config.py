"""`EpisodeConfig`: limits and serving options of agent episodes (`rollout.episode`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moe_rl.agents import parsers


@dataclass(kw_only=True)
class EpisodeConfig:
    max_turns: int = 8
    """Model turns per episode; one more `generate` ends the episode truncated (tokens kept)."""
    max_context_tokens: int = 4096
    """Prompt + every turn and environment token; reaching it ends the episode truncated. A turn's
    budget is min(rollout.max_new_tokens or the call's max_tokens, the context left)."""
    timeout_s: float = 600.0
    """Wall seconds per episode; past it the agent is cancelled and its group dropped
    (`agent_timeout`)."""
    tool_workers: int = 8
    """Threads for blocking tool code (`Episode.run_tool`), off the rollout loop."""
    tool_call_format: str = "auto"
    """How the model writes tool calls, by SGLang's `--tool-call-parser` name ("qwen25",
    "qwen3_coder", "deepseekv3", "deepseekv31", "glm45", "kimi_k2", "gpt-oss", "hermes":
    `moe_rl.agents.parsers.TOOL_PARSERS`); "auto": the model type's (`FAMILY_FORMATS`)."""
    reasoning_parser: str = "auto"
    """How the model writes reasoning, by SGLang's `--reasoning-parser` name ("qwen3",
    "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi_k2", "gpt-oss"); it becomes
    the turn's `reasoning_content`. "none": the whole turn is content; "auto": the model type's."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the chat template, for prompts and every turn, e.g. `{enable_thinking:
    false}` for Qwen3's non-thinking mode (an empty think block opens each turn)."""
    endpoint_host: str = "127.0.0.1"
    """Bind address of the OpenAI-compatible endpoint (loopback; "0.0.0.0" for agents in other
    processes, containers or machines)."""
    endpoint_port: int = 0
    """0: any free port (each episode's base URL carries it)."""

    def __post_init__(self):
        for name in ("max_turns", "max_context_tokens", "tool_workers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"rollout.episode.{name}={getattr(self, name)!r}: must be an integer >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"rollout.episode.timeout_s={self.timeout_s}: must be > 0 seconds")
        if self.tool_call_format != "auto":
            parsers.tool_parser(self.tool_call_format)
        if self.reasoning_parser != "auto":
            parsers.reasoning_parser(self.reasoning_parser)
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(
                f"rollout.episode.chat_template_kwargs={self.chat_template_kwargs!r}: must be a mapping of "
                "template arguments, e.g. {enable_thinking: false}"
            )
        if not 0 <= self.endpoint_port < 65536:
            raise ValueError(f"rollout.episode.endpoint_port={self.endpoint_port}: use 0 (any) or a port number")

    def resolved(self, model_type: str) -> "EpisodeConfig":
        """This config with "auto" formats replaced by those of HF `model_type` (ValueError naming
        the fields when the type has none)."""
        if "auto" not in (self.tool_call_format, self.reasoning_parser):
            return self
        tool_call_format, reasoning_parser = parsers.family_formats(model_type)
        return dataclasses.replace(
            self,
            tool_call_format=tool_call_format if self.tool_call_format == "auto" else self.tool_call_format,
            reasoning_parser=reasoning_parser if self.reasoning_parser == "auto" else self.reasoning_parser,
        )
