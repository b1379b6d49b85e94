"""The serving profile's report (lumen/profile/serving.py) on a made-up engine run whose times are known: every
part of a TTFT or an inter-token gap is accounted for, so the shares of each column add up to 100%."""
import json

import pytest

from lumen.profile import Profiler, Record, Step
from lumen.profile.serving import PARTS, Trace, report, save


def made_up_run():
    """Request a arrives at 0 and runs in steps 0-3, b arrives at 0.015 and waits for step 1. Each step is 10 ms
    on the clock; 8 ms of it is the step's own time (wall_s: schedule 1, forward 6, sample 1), 2 ms is the
    profiler's bookkeeping (the time it pauses itself for, left out of wall_s)."""
    prof = Profiler()
    for i in range(4):
        t0 = 0.001 + 0.010 * i
        reqs = ("a",) if i == 0 else ("a", "b")
        prof.steps.append(Step(i, "decode", len(reqs), len(reqs), 0, wall_s=0.008, t0=t0, t1=t0 + 0.010,
                               requests=reqs))
        prof.records += [Record(i, "decode", -1, "schedule", 0.001, 0, 0),
                         Record(i, "decode", 0, "qkv", 0.006, 1, 1), Record(i, "decode", -1, "sample", 0.001, 0, 0)]
    made = [0.011, 0.021, 0.031, 0.041]
    return prof, [Trace("a", 0.0, made), Trace("b", 0.015, made[1:])]


def test_the_parts_add_up_to_the_wall_time():
    rep = report(*made_up_run())
    assert rep["requests"] == 2 and rep["coverage_min"] == pytest.approx(1.0)
    for col in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
        parts = rep[col + "_parts"]
        assert set(parts) == set(PARTS)
        assert sum(parts.values()) == pytest.approx(1.0), (col, parts)
    itl = rep["itl_p50_parts"]                      # a 10 ms gap: one step
    assert itl["forward"] == pytest.approx(0.6) and itl["profiling"] == pytest.approx(0.2)
    assert rep["ttft_p99_parts"]["queue"] > 0       # b waited for step 1


def test_the_command_line_writes_what_it_says(tmp_path, capsys):
    """python -m lumen.profile --serving FILE --json F --plot P: the table, the summary line, and each file
    written named."""
    from lumen.profile.__main__ import main
    save(tmp_path / "s.json", *made_up_run())
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["--serving", str(tmp_path / "s.json"), "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "serving profile: 2 requests" in out and "profiling" in out
    assert f"wrote {out_json}" in out and f"wrote {out_png}" in out
    rep = json.loads(out_json.read_text())
    assert rep["requests"] == 2 and sum(rep["itl_p50_parts"].values()) == pytest.approx(1.0)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_request_not_streamed_has_no_inter_token_gaps():
    """A request answered in one response (all its tokens sent at once) saw no gaps between tokens: its 0 s
    'gaps' must not pull the ITL percentiles to 0; it is counted and said instead."""
    from lumen.profile.serving import summary_line
    prof, traces = made_up_run()
    whole = Trace("b", 0.015, traces[1].made, sent=[0.042] * len(traces[1].made))
    rep = report(prof, [traces[0], whole])
    assert rep["unstreamed"] == 1
    assert rep["itl_p50_s"] == pytest.approx(0.010)           # a's gaps only
    rep = report(prof, [whole])
    assert "itl_p50_s" not in rep and rep["ttft_p50_s"] == pytest.approx(0.042 - 0.015)
    assert "no ITL" in summary_line(rep) and "ITL p50 0.0" not in summary_line(rep)


def test_a_request_not_streamed_is_split_up_to_its_last_token():
    """Its TTFT is the whole response: the steps that made its later tokens are its forward passes (it runs from
    its arrival in step 1 to the end of step 3), not time spent sending. Only the gap from its last token to the
    response is "send"."""
    prof, traces = made_up_run()
    whole = Trace("b", 0.015, traces[1].made, sent=[0.042] * len(traces[1].made))
    parts = report(prof, [whole])["ttft_p50_parts"]
    wall = 0.042 - 0.015
    assert sum(parts.values()) == pytest.approx(1.0)
    assert parts["send"] == pytest.approx((0.042 - 0.041) / wall)
    assert parts["forward"] == pytest.approx(0.6 * (0.041 - 0.015) / wall)    # 6 ms of each 10 ms step
