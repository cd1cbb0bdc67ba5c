"""Agentic RL: multi-turn episodes with tools, driven by agent functions or any OpenAI client.

- `chat`: `ChatFormat`, the model's chat template and tool-call format as token ids
  (token-in-token-out), and `load_tokenizer`.
- `parsers`: tool-call and reasoning parsing per model family (SGLang's names), `ToolCall`.
- `episode`: `Episode`, the record of one trajectory and the handle agents drive.
- `runner`: `AgentRunner`, one group's episodes with limits and outcomes.
- `endpoint`: `ChatEndpoint`, `/v1/chat/completions` per episode for OpenAI-SDK agents.
- `config`: `EpisodeConfig` (`rollout.episode`).
- `tiny_tokenizer`: the small chat tokenizer of the CPU demos and tests.
See docs/agents.md.
"""

from moe_rl.agents.chat import ChatFormat, load_tokenizer
from moe_rl.agents.config import EpisodeConfig
from moe_rl.agents.endpoint import ChatEndpoint
from moe_rl.agents.episode import Episode, EpisodeLimit, Turn
from moe_rl.agents.parsers import ToolCall
from moe_rl.agents.runner import AgentFailure, AgentRunner

__all__ = [
    "AgentFailure",
    "AgentRunner",
    "ChatEndpoint",
    "ChatFormat",
    "Episode",
    "EpisodeConfig",
    "EpisodeLimit",
    "ToolCall",
    "Turn",
    "load_tokenizer",
]
