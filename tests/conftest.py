"""Shared set-up: the modules of tests/support/ importable from every folder of tests (`from helpers import ...`),
the examples' modules importable (`import run_mlm`, `from lib import shakespeare`, ...), as they are for the scripts
themselves, a local Hugging Face Hub server for push/load tests without a network, and a stand-in for the flash-attn
kernel."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

import pytest  # noqa: E402
from helpers import EXAMPLES, STAND_IN, stand_in_calls, varlen_stand_in  # noqa: E402
from hub_server import HubServer  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

from roformer_hf import attention  # noqa: E402

sys.path.insert(0, str(EXAMPLES))


@pytest.fixture
def local_hub(tmp_path_factory):
    """A running `HubServer` (stopped at teardown), for tests that inspect what was pushed."""
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture
def hub_server(local_hub):
    """The endpoint URL of a running local Hub, to pass as `HF_ENDPOINT` to client processes."""
    return local_hub.url


@pytest.fixture
def stand_in_flash(monkeypatch):
    """The flash-attn code path with `helpers.varlen_stand_in` as its kernel; returns the list of its calls."""
    AttentionInterface.register(STAND_IN, varlen_stand_in)
    monkeypatch.setattr(attention, "is_flash_attention_requested",  # where the forward chooses its kernel, once
                        lambda requested_attention_implementation: requested_attention_implementation == STAND_IN)
    stand_in_calls.clear()
    return stand_in_calls
