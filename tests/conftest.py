"""Shared set-up: the examples' modules importable (`import shakespeare`, `import run_mlm`, ...), as they are for the
scripts themselves, and a local Hugging Face Hub server for push/load tests without a network."""

import sys

import pytest
from helpers import EXAMPLES
from hub_server import HubServer

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
