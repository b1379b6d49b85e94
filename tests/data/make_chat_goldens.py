"""Make tests/data/qwen2.5-chat.llamacpp.json: Qwen2.5-Coder's chat template rendered by llama.cpp's `llama-server
--jinja`, tools included, for tests/format/test_chat_template.py to hold lumen.format.chat to.

For each model (the 0.5B and the 1.5B, whose templates differ in one line), this script starts llama-server on
127.0.0.1 (`-m MODEL --jinja -t 2 -c 2048`), waits for /health, posts every case of CASES below to
`POST /apply-template` (`{"messages": [...], "tools": [...], "add_generation_prompt": ...}`) and records the
`prompt` it returns; then it stops the server. The JSON holds each model's template text (read from the GGUF with
gguf-py, so the test can render it without the model file), its sha256, and per case the request and the prompt.

Tool:     llama-server built from the llama.cpp that llama-cpp-python 0.3.36 vendors (its --version is recorded).
Models:   the files Lumen's model store fetches, checked by sha256.
Cases:    every case ends with a user or tool message (llama-server treats a final assistant message as a
          prefill to continue, which is not what a chat template renders).

Command (from the repository root, Lumen's venv active; about 30 s):
    python tests/data/make_chat_goldens.py --server /path/to/llama-server
"""
import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city (°C, the city's own name: 서울, Zürich)",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city, e.g. \"Paris\""},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
RUN_PYTHON = {"type": "function", "function": {
    "name": "run_python", "description": "Run Python code and return what it prints <stdout> & 'stderr'",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"},
                                                   "timeout": {"type": "number", "default": 5.0}},
                   "required": ["code"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"unit\": \"celsius\"}"}}
CALL_2 = {"id": "call_2", "type": "function",
          "function": {"name": "run_python", "arguments": "{\"code\":\"print(2**10)\"}"}}

CASES = [
    {"name": "system-user", "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]},
    {"name": "default-system-multi-turn", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a haiku about C++ <templates> & \"quotes\"."}]},
    {"name": "no-generation-prompt", "add_generation_prompt": False, "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"}]},
    {"name": "tools", "tools": [WEATHER, RUN_PYTHON], "messages": [
        {"role": "user", "content": "What's the weather in Zürich?"}]},
    {"name": "tools-with-system", "tools": [RUN_PYTHON], "messages": [
        {"role": "system", "content": "You are a coding assistant."},
        {"role": "user", "content": "Compute 2**10 with Python."}]},
    {"name": "tool-call-and-result", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "What's the weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"}]},
    {"name": "parallel-calls-text-and-follow-up", "tools": [WEATHER, RUN_PYTHON], "messages": [
        {"role": "system", "content": "Use tools when they help."},
        {"role": "user", "content": "Weather in Zürich, and 2**10?"},
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [CALL, CALL_2]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 °C, clear"},
        {"role": "tool", "tool_call_id": "call_2", "content": "1024"},
        {"role": "assistant", "content": "It is 21 °C and clear in Zürich; 2**10 = 1024."},
        {"role": "user", "content": "Thanks!"}]},
    {"name": "tool-keys-in-another-order-no-description", "tools": [
        {"function": {"parameters": {"properties": {"q": {"type": "string"}}, "type": "object"}, "name": "search",
                      "strict": True}, "type": "function"}], "messages": [
        {"role": "user", "content": "Search for numba"}]},
    {"name": "tool-call-without-tools-list", "messages": [
        {"role": "user", "content": "Run print(1)"},
        {"role": "assistant", "content": "", "tool_calls": [CALL_2]},
        {"role": "tool", "tool_call_id": "call_2", "content": "1"}]},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def render_all(server: str, model_path: str) -> list[dict]:
    """Start llama-server on the model, render every case, stop it."""
    port = free_port()
    proc = subprocess.Popen([server, "-m", model_path, "--jinja", "-t", "2", "-c", "2048", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):                          # up to 60 s for the model to load
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                sys.exit(f"llama-server exited: {proc.stderr.read()[-2000:]}")
            time.sleep(0.1)
        else:
            sys.exit("llama-server did not become healthy in 60 s")
        out = []
        for case in CASES:
            body = {"messages": case["messages"], "add_generation_prompt": case.get("add_generation_prompt", True)}
            if "tools" in case:
                body["tools"] = case["tools"]
            out.append({**case, "add_generation_prompt": body["add_generation_prompt"],
                        "prompt": post(base + "/apply-template", body)["prompt"]})
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", required=True, help="the llama-server binary")
    ap.add_argument("--out", default=os.path.join(HERE, "qwen2.5-chat.llamacpp.json"))
    args = ap.parse_args(argv)
    from lumen.format.chat import chat_template_from_metadata
    from lumen.format.gguf import GGUFFile
    from lumen.model.store import MODELS as REGISTRY, resolve, sha256_file

    version = subprocess.run([args.server, "--version"], capture_output=True, text=True)
    models = {}
    for name in MODELS:
        path = resolve(name, quiet=True)
        if sha256_file(path) != REGISTRY[name].sha256:
            sys.exit(f"{path}: not the registered file")
        template = chat_template_from_metadata(GGUFFile(path).metadata)
        models[name] = {"model_file": path.name, "model_sha256": REGISTRY[name].sha256, "template": template,
                        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
                        "cases": render_all(args.server, str(path))}
        print(f"{name}: {len(CASES)} cases rendered")
    out = {"what": "Qwen2.5-Coder chat templates rendered by llama-server --jinja (POST /apply-template); made by "
                   "tests/data/make_chat_goldens.py",
           "llama_server_version": (version.stdout + version.stderr).strip().splitlines()[-2:],
           "command": "python tests/data/make_chat_goldens.py --server llama-server",
           "models": models}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
