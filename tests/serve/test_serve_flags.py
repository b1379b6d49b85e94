"""`python -m lumen.serve` refuses a bad or contradictory flag with one line and exit code 2, before the model
loads (so each case here takes well under a second)."""
import pytest

from lumen.serve.cli import main


@pytest.mark.parametrize("flags, message", [
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be"),
    (["--max-body-mb", "nan"], "--max-body-mb must be"),
    (["--kv-cache-mb", "inf"], "--kv-cache-mb must be a positive number"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--threads", "-2"], "--threads must be at least 1"),
    (["--threads", "100000"], "--threads must be between 1 and"),
    # every integer range of the engine's flags in one wording (it was "a positive integer" here, "an integer in
    # [1, 16777216]" for generate's --ctx)
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be at least 1, got 0"),
    (["--speculative", "ngram", "--num-speculative-tokens", "17"], "--num-speculative-tokens must be between 1 and 16, "
                                                                "got 17"),
    (["--scheduler", "fcfs", "--pace", "3"], "--pace sets the paced scheduler"),
    (["--scheduler", "measured", "--pace", "3"], "--pace sets the paced scheduler"),
    (["--slo-ttft-ms", "500", "--pace", "3"], "--pace sets the paced scheduler"),
    (["--scheduler", "fcfs", "--slo-tpot-ms", "20"], "targets of the measured scheduler"),
    (["--kv-cache-mb", "1e12"], "--kv-cache-mb must be a positive number of megabytes, below 1e9, got 1000000000000.0"),
    (["--max-queue", "-1"], "--max-queue must be at least 1, got -1"),
    # an empty key ("$KEY" unset) asked for the key "", and an empty name fell back to the model's, unsaid
    (["--api-key", ""], "--api-key must not be empty"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
    # the profile is written at shutdown: a directory that does not exist lost the whole run's profile
    (["--profile", "/nonexistent-dir/p.json"], "cannot write the serving profile to /nonexistent-dir/p.json: the "
                                               "directory /nonexistent-dir does not exist"),
    (["--profile", "."], "the serving profile path . is a directory"),
])
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "smollm2-135m", "--port", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and message in err[-1] and "Traceback" not in "".join(err)


def test_unchunked_prefill_needs_a_budget_for_the_longest_prompt(capsys, smollm2_path):
    """--no-chunked-prefill with a step budget below the served length: a longer prompt would wait forever, so the
    server refuses to start (before loading when --max-model-len is given, else once the length is known)."""
    with pytest.raises(SystemExit) as e:
        main(["--model", "smollm2-135m", "--no-chunked-prefill", "--max-num-batched-tokens", "64",
              "--max-model-len", "128"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--max-num-batched-tokens >= --max-model-len (64 < 128)" in err[-1]
    from lumen.engine.config import EngineConfig
    from lumen.errors import LumenError
    from lumen.serve.app import load_engine
    with pytest.raises(LumenError, match=r"chunked prefill off.*\(64 < \d+\)"):
        load_engine(smollm2_path, EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64,
                                               kv_cache_mb=8, threads=1))
    EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=128).check_unchunked(128)
