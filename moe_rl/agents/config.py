"""`EpisodeConfig`: limits and serving options of agent episodes (`rollout.episode`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_rl.agents.chat import TOOL_CALL_FORMATS


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
    tool_call_format: str = "hermes"
    """How tool calls are written in the model's text: "hermes" (<tool_call>{json}</tool_call>:
    Qwen2.5, Qwen3, Hermes)."""
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
        if self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"rollout.episode.tool_call_format={self.tool_call_format!r}: supported formats are "
                f"{TOOL_CALL_FORMATS} (<tool_call>{{json}}</tool_call>)"
            )
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError(
                f"rollout.episode.chat_template_kwargs={self.chat_template_kwargs!r}: must be a mapping of "
                "template arguments, e.g. {enable_thinking: false}"
            )
        if not 0 <= self.endpoint_port < 65536:
            raise ValueError(f"rollout.episode.endpoint_port={self.endpoint_port}: use 0 (any) or a port number")
