"""The Hermes tool-call parser on random calls (seeded): tagged blocks after some content, or bare / ```json-fenced
calls, whose argument keys and strings hold the markers and JSON punctuation ("</tool_call>", "```", '{"name": ',
quotes, backslashes, braces). Read whole, the text gives back exactly its calls (names and argument objects) and
content; read in random chunks (a stream), the same."""
from __future__ import annotations

import json
import random

import pytest

from lumen.serve.tools import HermesParser, assemble

NAMES = ["add", "get_weather", "a.b-c"]
TRICKY = ['"', "\\", "}", "{", "]", "</tool_call>", "<tool_call>", "```", '{"name": "add"', "\n", "\\n", ": ", ",",
          " ", "é😀", "x"]


def _string(rng: random.Random) -> str:
    return "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 6)))


def _value(rng: random.Random, depth: int = 0):
    k = rng.random()
    if depth > 2 or k < 0.3:
        return rng.choice([1, -2.5, True, None, _string(rng)])
    if k < 0.6:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_string(rng) or "k": _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _call(rng: random.Random) -> tuple[str, dict, str]:
    name, args = rng.choice(NAMES), {_string(rng) or "a": _value(rng) for _ in range(rng.randint(0, 3))}
    ws = rng.choice(["", " ", "\n", "\n  "])
    text = json.dumps(args, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)
    return name, args, "{" + ws + '"name": ' + json.dumps(name) + "," + ws + '"arguments": ' + text + ws + "}"


def _parse(text: str, sizes: list[int]) -> tuple[str, list[tuple[str, str]]]:
    p, content, deltas, at = HermesParser(names=NAMES), [], [], 0
    for n in sizes:
        c, d = p.feed(text[at:at + n])
        content.append(c)
        deltas += d
        at += n
    c, d = p.finish()
    return "".join(content) + c, [(x["function"]["name"], x["function"]["arguments"]) for x in assemble(deltas + d)]


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_parse_back_whole_and_streamed(seed):
    rng = random.Random(seed)
    for _ in range(150):
        calls = [_call(rng) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.6:
            content = rng.choice(["", "Sure.", "Let me check.\n"])
            text = content.rstrip("\n") + ("\n" if content else "") + "\n".join(
                "<tool_call>\n" + c + "\n</tool_call>" for _, _, c in calls)
        else:
            content, lead = "", rng.choice(["", "```json\n", "```\n"])
            text = lead + "\n".join(c for _, _, c in calls) + ("\n```" if lead else "")
        whole = _parse(text, [len(text)])
        assert whole[0] == content.rstrip("\n"), text
        assert [(n, json.loads(a)) for n, a in whole[1]] == [(n, a) for n, a, _ in calls], text
        for _ in range(3):
            sizes, left = [], len(text)
            while left > 0:
                sizes.append(min(rng.randint(1, 8), left))
                left -= sizes[-1]
            assert _parse(text, sizes) == whole, (text, sizes)
