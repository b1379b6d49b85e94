"""CORS: a page of another origin may call the API from a browser (vLLM's and llama-server's default: any origin),
its preflight answered before the API key is asked for (a browser sends none with it); --allowed-origins narrows
it to the pages named, or "" to none; a bad value is a usage error. Live servers over SmolLM2 (test_serve's)."""
import argparse

import httpx
import pytest

import lumen
from lumen.serve.cli import allowed_origins, build_parser
from test_serve import live_server

PAGE = "http://localhost:3000"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def model(smollm2_path):
    return lumen.load(smollm2_path, ctx=2048, threads=2)


def test_any_origin_by_default_and_the_preflight_needs_no_key(model):
    with live_server(model, api_key="k") as s, httpx.Client(base_url=s.url, timeout=60) as c:
        pre = c.options("/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = c.post("/v1/completions", headers={"Origin": PAGE, "Authorization": "Bearer k"},
                   json={"model": "smol", "prompt": "Hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        denied = c.post("/v1/completions", headers={"Origin": PAGE}, json={"model": "smol", "prompt": "Hi"})
        assert denied.status_code == 401                         # CORS lets the page call, not skip the key
        assert denied.headers["access-control-allow-origin"] == "*"   # (so its script can read why)


def test_only_the_origins_named(model):
    with live_server(model, allowed_origins=(PAGE,)) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        assert c.options("/v1/models", headers=PREFLIGHT).headers["access-control-allow-origin"] == PAGE
        other = c.options("/v1/models", headers={**PREFLIGHT, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = c.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with live_server(model, allowed_origins=()) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.get("/v1/models", headers={"Origin": PAGE})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert c.options("/v1/models", headers=PREFLIGHT).status_code == 405      # no CORS: a wrong method


@pytest.mark.parametrize("text, origins", [
    ("*", ("*",)), ("", ()), ("[]", ()),
    ("http://a.example, https://b.example:8443/", ("http://a.example", "https://b.example:8443")),
    ('["http://a.example", "*"]', ("http://a.example", "*")),
])
def test_the_flag_reads(text, origins):
    assert allowed_origins(text) == origins
    assert build_parser().parse_args(["--allowed-origins", text]).allowed_origins == origins


@pytest.mark.parametrize("text", ["localhost:3000", "http://a.example/path", "ftp://a.example", "[1, 2]", "[oops",
                                  "http://a.example,", "http://a.example,,*", '[""]', " , "])
def test_a_bad_value_is_a_usage_error(text, capsys):
    with pytest.raises(argparse.ArgumentTypeError):
        allowed_origins(text)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--allowed-origins", text])
    assert e.value.code == 2 and "--allowed-origins" in capsys.readouterr().err
