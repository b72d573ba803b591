"""`http.api_key` through `specserve serve`: no key or a wrong key gets a 401
with an OpenAI-style body; the right key is served.

Its own module (and server) so it never runs beside test_serve.py's app: two
Serve apps starting at once on a 2-core machine took CI past its wait.
"""

import pytest

from test_serve import tiny_config
from specserve.tools.serveproc import ServeProcess, post

pytestmark = pytest.mark.slow

KEY = {"Authorization": "Bearer sesame"}


def test_api_key_is_required_when_set(tiny_models, tmp_path):
    config = tiny_config(tiny_models, [])
    config["http"] = {"api_key": "sesame"}
    server = ServeProcess(config, tmp_path)
    try:
        server.wait_ready("tiny", headers=KEY)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        status, err = post(f"{server.url}/v1/completions", body)
        assert status == 401 and err["error"]["type"] == "authentication_error"
        status, err = post(f"{server.url}/v1/completions", body,
                           {"Authorization": "Bearer wrong"})
        assert status == 401 and err["error"]["type"] == "authentication_error"
        status, ok = post(f"{server.url}/v1/completions", body, KEY)
        assert status == 200 and ok["usage"]["completion_tokens"] == 2
    finally:
        assert server.stop(require_clean=True) == 0, server.tail()
