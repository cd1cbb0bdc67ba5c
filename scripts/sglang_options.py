"""Write moe_rl/engine/sglang_options.json, the table of SGLang 0.5.23's server options, from SGLang's own code.

    python scripts/sglang_options.py

SGLang's argparse parser (`ServerArgs.add_cli_args`) is built in a process of the conformance tier's
oracle (`tests/conformance/sglang_oracle.py`: the wheel unpacked into .cache/, downloaded on first
use) and read by `moe_rl.engine.sglang_options.read_parser`. `tests/conformance/test_sglang_options.py`
fails when the shipped table and SGLang's code differ: rerun this script after moving SGLang.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repository's packages

from moe_rl.engine.sglang_options import TABLE, read_parser  # noqa: E402
from tests.conformance import sglang_oracle  # noqa: E402


def main() -> None:
    table = sglang_oracle.call(read_parser)
    rows = ",\n".join(f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in table["options"].items())
    TABLE.write_text(
        f'{{\n "sglang": {json.dumps(table["sglang"])},\n'
        f' "ep_spanning_a2a_backends": {json.dumps(table["ep_spanning_a2a_backends"])},\n'
        f' "options": {{\n{rows}\n }}\n}}\n'
    )  # one option a line: a new SGLang's changes read as a diff
    print(f"{TABLE}: {len(table['options'])} options of SGLang {table['sglang']}")


if __name__ == "__main__":
    main()
