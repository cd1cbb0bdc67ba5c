"""The conformance tier: the project's SGLang path checked against SGLang 0.5.23's own code on CPU.

The first use downloads SGLang's wheel and a few small packages into `.cache/` (see
`tests/conformance/sglang_oracle.py`); nothing is installed into the project's environment."""

import pytest

from tests.conformance import sglang_oracle


@pytest.fixture(scope="session", autouse=True)
def sglang_wheel():
    return sglang_oracle.ensure()
