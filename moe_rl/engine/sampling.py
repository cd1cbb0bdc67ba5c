"""`SamplingParams`: SGLang's `sampling_params` of one `/generate`, the fields this project uses.

The client sends them (`EngineClient.generate(input_ids, sampling)`) and the embedded engine
parses a body's into them; both under SGLang 0.5.23's names and defaults
(`sglang/srt/sampling/sampling_params.py`; `moe_rl.engine.protocol` lists every field SGLang
accepts, and the conformance tests check bodies against SGLang's own class).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    """New tokens at most (the request ends with finish reason "length" there)."""
    temperature: float = 1.0
    """0 samples greedily."""
    top_p: float = 1.0
    top_k: int = -1
    """-1: every token."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Tokens that end the request (finish reason "stop") besides the model's EOS."""
    sampling_seed: int | None = None
    """Seeds this request's sampling (None: the engine's own randomness)."""
    ignore_eos: bool = False
    """Keep going past EOS and stop tokens, to `max_new_tokens`."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    def body(self) -> dict:
        """The JSON form (`sampling_params` of a /generate body): every field but an unset seed and
        an empty stop list."""
        body = dataclasses.asdict(self)
        if self.sampling_seed is None:
            del body["sampling_seed"]
        if not self.stop_token_ids:
            del body["stop_token_ids"]
        return body
