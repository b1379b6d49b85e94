"""The logprobs of a response (lumen.serve.responses.Reply), without a server or a model: a byte tokenizer whose
BOS is a control token, so that prompts hold tokens that are not in the text and characters split over tokens."""
from __future__ import annotations

from lumen.engine.sequence import RequestMetrics, RequestOutput
from lumen.serve.prompts import Prompter
from lumen.serve.responses import Reply

BOS, EOS = 256, 257


class ControlByteTokenizer:
    """Token i < 256 is byte i; 256 and 257 are BOS and EOS, control tokens: in text only with special=True."""
    n_vocab, bos_id, eos_id, add_bos_default = 258, BOS, EOS, True

    def token_bytes(self, i: int, special: bool = False) -> bytes:
        if i < 256:
            return bytes([i])
        return (b"<s>", b"</s>")[i - 256] if special else b""

    def token_text(self, i: int) -> str:
        return self.token_bytes(i, special=True).decode()


def entry(tok: int) -> tuple:
    return (-0.5, [(tok, -0.5)])


def completion_reply(prompt: list[int], echo: str | None) -> Reply:
    return Reply("completion", "cmpl-x", "bytes", 0, Prompter(ControlByteTokenizer(), None, 64), n=1,
                 prompts=[prompt], logprobs=0, echo=None if echo is None else [echo])


def output(prompt, ids, text, finished=True, delta=None, echo=True) -> RequestOutput:
    """(the engine scores the prompt only for echo with logprobs)"""
    return RequestOutput("r0", prompt, list(ids), text, finished, "length" if finished else None,
                         RequestMetrics(prompt_tokens=len(prompt)), delta_token_ids=list(delta or ids),
                         delta_text=text, logprobs=[entry(t) for t in ids],
                         prompt_logprobs=[None] + [entry(t) for t in prompt[1:]] if echo else None)


PROMPT_TEXT, GEN_TEXT = "Hé", " ü!"
PROMPT = [BOS, *PROMPT_TEXT.encode()]                  # BOS H 0xC3 0xA9
GEN = list(GEN_TEXT.encode())                          # ' ' 0xC3 0xBC '!'


def check_offsets(text: str, lp: dict) -> None:
    """Each token whose text is whole characters is found in the text at its offset; offsets never go back."""
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    for tok, o in zip(lp["tokens"], offsets):
        if "\ufffd" not in tok and tok not in ("<s>", "</s>"):
            assert text[o:o + len(tok)] == tok, (tok, o, text)


def test_echo_text_offsets_count_characters_of_the_text():
    """With echo the offsets index the returned text: BOS (not in it) takes no room, and a character split over
    two tokens is one character; generated tokens go on from the echoed prompt's end."""
    reply = completion_reply(PROMPT, PROMPT_TEXT)
    reply.finals[0] = output(PROMPT, GEN, GEN_TEXT)
    choice = reply.body()["choices"][0]
    assert choice["text"] == "Hé ü!"
    lp = choice["logprobs"]
    assert lp["text_offset"] == [0, 0, 1, 1, 2, 3, 3, 4]
    check_offsets(choice["text"], lp)


def test_streamed_text_offsets_equal_the_whole_ones():
    """A stream's chunks carry the same offsets as the whole response, however the tokens are split."""
    whole = completion_reply(PROMPT, PROMPT_TEXT)
    whole.finals[0] = output(PROMPT, GEN, GEN_TEXT)
    want = whole.body()["choices"][0]["logprobs"]["text_offset"]
    reply = completion_reply(PROMPT, PROMPT_TEXT)
    got = []
    for k, (lo, hi) in enumerate([(0, 2), (2, 3), (3, 4)]):
        out = output(PROMPT, GEN[:hi], "", finished=hi == len(GEN), delta=GEN[lo:hi])
        got += reply.chunks(0, out, False)[0]["choices"][0]["logprobs"]["text_offset"]
    assert got == want


def test_text_offsets_without_echo_start_at_0():
    reply = completion_reply(PROMPT, None)
    reply.finals[0] = output(PROMPT, GEN, GEN_TEXT, echo=False)
    choice = reply.body()["choices"][0]
    assert choice["logprobs"]["text_offset"] == [0, 1, 1, 2]
    check_offsets(choice["text"], choice["logprobs"])


def test_echoed_control_token_text_takes_its_room():
    """A prompt that spells a control token ("</s>" parsed as EOS) echoes that text: the offsets count it, while
    the BOS the tokenizer added (not in the text) takes none."""
    text = "a</s>b"
    prompt = [BOS, ord("a"), EOS, ord("b")]
    reply = completion_reply(prompt, text)
    reply.finals[0] = output(prompt, [ord("!")], "!")
    choice = reply.body()["choices"][0]
    assert choice["text"] == "a</s>b!"
    assert choice["logprobs"]["text_offset"] == [0, 0, 1, 5, 6]
    check_offsets(choice["text"], choice["logprobs"])


def test_top_logprobs_of_tokens_with_one_text_keep_the_sampled_ones():
    """Byte tokens that are not whole characters all read U+FFFD: in the legacy {text: logprob} map the sampled
    token's text holds its own logprob (as token_logprobs says), any other text its likeliest token's."""
    reply = completion_reply([ord("a")], None)
    out = output([ord("a")], [0xA9, 0x41], "\ufffdA", echo=False)
    out.logprobs = [(-2.0, [(0xC3, -0.5), (0xA9, -2.0), (0xC4, -3.0)]),
                    (-0.1, [(0x41, -0.1), (0xC3, -4.0), (0xC4, -5.0)])]
    reply.finals[0] = out
    lp = reply.body()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-2.0, -0.1]
    assert lp["top_logprobs"] == [{"\ufffd": -2.0}, {"A": -0.1, "\ufffd": -4.0}]
    for tok, x, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[tok] == x
