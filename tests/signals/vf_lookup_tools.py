"""The `lookup` tool of tests/signals/vf_lookup.py: an MCP server verifiers starts as
`python -m tests.signals.vf_lookup_tools` (its subprocess runtime)."""

import verifiers.v1 as vf

TABLE = {k: f"{k.lower()}{i}" for i, k in enumerate("ABCDEFGHIJ")}  # A -> a0, B -> b1, ...


class LookupToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # advertised as `lookup`, the name the tiny chat tokenizer's call tokens use

    @vf.tool
    def lookup(self, key: str) -> str:
        """The table's value of `key`."""
        return TABLE.get(key, f"no key {key!r}")


if __name__ == "__main__":
    LookupToolset.run()
