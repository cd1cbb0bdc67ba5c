"""verifiers' own chat harness, run by this interpreter: the harness moe-rl gives every verifiers
episode (`moe_rl.signals.verifiers_env`).

verifiers runs an agent as a program that talks to the model over HTTP; its chat program (the
`null` harness: the chat loop with the task's MCP tools) declares its packages as a PEP 723
script, and verifiers installs them with `uv` in the agent's runtime. moe-rl's `.venv` already
holds them (openai, mcp, httpx, tenacity: verifiers' own dependencies), so this harness runs the
same program with `sys.executable` in verifiers' local subprocess runtime: nothing is downloaded
while a run trains. Everything else is verifiers': the program's text, its arguments, the
interception server it calls, the tool servers, the trace.
"""

from __future__ import annotations

import hashlib
import sys

from verifiers.v1.harnesses.null import NullHarness

HARNESS_ID = "moe_rl_chat"
"""The harness's id in an agent's config: verifiers' loader imports harnesses by top-level module
name (`verifiers.v1.utils.loaders`), so this module is registered under it too."""

__all__ = ["ThisInterpreterChatHarness"]


class ThisInterpreterChatHarness(NullHarness):
    """verifiers' `null` harness (its chat program) without the `uv` install."""

    async def setup(self, runtime) -> None:
        """Nothing to install: this interpreter has the program's packages."""

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        return await super().launch(
            ctx, trace, _ThisInterpreter(runtime), endpoint, secret, mcp_urls, data, tool_interception_url
        )


class _ThisInterpreter:
    """`runtime`, except that a PEP 723 script runs with `sys.executable` as it is."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name: str):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *, activate=True):
        data = script.encode() if isinstance(script, str) else script
        path = f".moe-rl-{hashlib.sha256(data).hexdigest()[:16]}.py"
        await self._runtime.write(path, data)
        return [sys.executable, path]


sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
