"""What an Engine is built with, validated in one place: `EngineConfig` (sizes, scheduling, threads) and
`SpeculativeConfig` (drafting). Both are frozen; a bad value raises ValueError naming the field.

    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, kv_cache_mb=512)
    engine = lumen.Engine("smollm2-135m", config=cfg)          # or the same fields as keywords:
    engine = lumen.Engine("smollm2-135m", max_num_seqs=16, max_num_batched_tokens=512, kv_cache_mb=512)

Sizes the engine derives from a config and the model (the KV pool's block count, the context) are computed by
`kv_blocks` and `EngineConfig.model_len`, never at call sites.

Every command line declares the engine's flags from one table here (as vLLM's EngineArgs does):

    EngineConfig.add_cli_args(parser, only=("threads", "adaptive_threads"))   # the flags this tool takes
    cfg = EngineConfig.from_cli_args(args, max_num_seqs=4)                    # its fixed choices on top
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

DEFAULT_KV_CACHE_MB = 1024        # capped at a fifth of the memory available when the engine starts
MAX_SPECULATIVE_TOKENS = 16
DRAFT_QUANTS = ("q4_0", None)       # what a draft model can be requantized to as it loads (None: as stored)


def check_int(name: str, v, lo: int = 1, hi: int | None = None) -> None:
    """The one integer check of the engine's options: ValueError naming `name` unless lo <= v (<= hi), in one
    wording for every flag and field: "must be at least 1", "must be between 1 and 16"."""
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        what = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise ValueError(f"{name} must be {what}, got {v!r}")


def check_bool(name: str, v, *, none_ok: bool = False) -> None:
    """The one switch check: ValueError naming `name` unless v is True or False (or None where none_ok). A string
    is truthy: adaptive_threads="no" or enable_prefix_caching="false" turned the switch on."""
    if not (isinstance(v, bool) or (none_ok and v is None)):
        raise ValueError(f"{name} must be True or False{' or None' if none_ok else ''}, got {v!r}")


def _seconds(name: str, v) -> None:
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e6):
        raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")


def _choice(name: str, v, options: tuple) -> None:
    if v not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}, got {v!r}")


DRAFT_QUANT_FLAGS = tuple(q or "none" for q in DRAFT_QUANTS)     # --draft-quant's choices


def draft_quant_flag(v: str) -> str | None:
    """--draft-quant's value as SpeculativeConfig.draft_quant ("none": None)."""
    return None if v == "none" else v


def draft_requant(quant: str | None):
    """SpeculativeConfig.draft_quant as the loader takes it (lumen.model.weights.load_weights' requant)."""
    from ..format.quants import QT
    return None if quant is None else QT[quant.upper()]


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (per request: SamplingParams(speculative="ngram" | "draft")).
    draft_model: a model with the target's vocabulary (name, path or lumen.Model) for "draft";
    num_speculative_tokens: the most tokens drafted per step (a request may ask for fewer);
    ngram_min/ngram_max: the n-gram sizes the "ngram" drafter matches (lumen.engine.speculative);
    adaptive_k: choose each step's k from the request's acceptance rate and the measured step costs (False: always
    the most, as a fixed-k engine does);
    draft_vocab: the draft model's head computes the logits of the first draft_vocab token ids only (None, or more
    than the vocabulary: all, so the default fits any model;
    lossless either way: lumen.engine.speculative.drafters.DraftModel);
    draft_quant: "q4_0": a draft model given by name or path has its matrices stored in more bits per weight
    requantized to Q4_0 as it loads (a drafted token reads them all; the draft's precision moves only how many
    drafts are accepted, never the output); None: as stored (a loaded lumen.Model is used as it was loaded)."""
    draft_model: object = None
    num_speculative_tokens: int = 5
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive_k: bool = True
    draft_vocab: int | None = 32768
    draft_quant: str | None = "q4_0"

    def __post_init__(self):
        check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        check_int("ngram_min", self.ngram_min, 1, MAX_SPECULATIVE_TOKENS)
        check_int("ngram_max", self.ngram_max, self.ngram_min, MAX_SPECULATIVE_TOKENS)
        check_bool("adaptive_k", self.adaptive_k)
        if self.draft_vocab is not None:
            check_int("draft_vocab", self.draft_vocab, 64)
        if self.draft_quant not in DRAFT_QUANTS:
            raise ValueError(f"draft_quant must be one of {', '.join(map(repr, DRAFT_QUANTS))}, got "
                             f"{self.draft_quant!r}")


@dataclass(frozen=True)
class EngineConfig:
    """threads: the most threads a step uses (None: all Numba's, NUMBA_NUM_THREADS); adaptive_threads: fewer while
    other processes (or a server's event loop) want the cores (lumen.engine.threads), else always `threads`.
    max_model_len: longest prompt + output (None: the model's trained context, or with fit_model_len what the KV
    pool holds if that is less; a given max_model_len beyond the pool is refused with fit_model_len, else each
    request is checked against the pool when it arrives).
    max_num_seqs: sequences holding blocks at once; max_num_batched_tokens: tokens per step (the largest budget).
    kv_cache_mb: the KV block pool's size (None: min(1024, a fifth of the available memory)); num_kv_blocks: the
    pool's size in blocks instead (wins over kv_cache_mb).
    scheduler: None (the default: "measured" when an SLO target is given, else "paced"), "paced" (a prompt chunk rides along with running decodes only while the step stays
    within `pace` times a decode step's measured time, so streams never stall on another request's prefill),
    "fcfs" (a fixed token budget: max_num_batched_tokens every step) or "measured": each step's budget chosen from
    a fitted model of this machine's step costs (lumen.engine.costs.steps, lumen.engine.costs.budget), for the SLO
    targets slo_ttft_s and slo_tpot_s when given (goodput), else for throughput. cost_grid: "full" (~30 s, cached in $LUMEN_HOME/costs)
    or "tiny" (tests). explain: log every step's decision. pack_cache: see lumen.model.packcache.
    kv_hold_timeout_s: how long a finished request's KV is held for a transfer to a decode engine before it is
    released (lumen.engine.kv_transfer)."""
    threads: int | None = None
    adaptive_threads: bool = True
    max_model_len: int | None = None
    fit_model_len: bool = False
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    kv_cache_mb: float | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    pack_cache: bool | None = None
    scheduler: str | None = None
    pace: float = 1.5
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    cost_grid: str = "full"
    explain: bool = False
    kv_hold_timeout_s: float = 60.0
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self):
        if self.threads is not None:
            check_int("threads", self.threads)
        for name in ("adaptive_threads", "fit_model_len", "enable_prefix_caching", "enable_chunked_prefill",
                     "explain"):
            check_bool(name, getattr(self, name))
        check_bool("pack_cache", self.pack_cache, none_ok=True)
        check_int("max_num_seqs", self.max_num_seqs)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks)
        mb = self.kv_cache_mb
        if mb is not None and (not isinstance(mb, (int, float)) or isinstance(mb, bool) or not 0 < mb < 1e9):
            raise ValueError(f"kv_cache_mb must be a positive number of megabytes, below 1e9, got {mb!r}")
        slo = self.slo_ttft_s is not None or self.slo_tpot_s is not None
        if self.scheduler is None:
            object.__setattr__(self, "scheduler", "measured" if slo else "paced")
        _choice("scheduler", self.scheduler, ("paced", "fcfs", "measured"))
        if not isinstance(self.pace, (int, float)) or isinstance(self.pace, bool) or not 1.0 <= self.pace <= 100:
            raise ValueError(f"pace must be a number in [1, 100], got {self.pace!r}")
        _choice("cost_grid", self.cost_grid, ("full", "tiny"))
        _seconds("slo_ttft_s", self.slo_ttft_s)
        _seconds("slo_tpot_s", self.slo_tpot_s)
        _seconds("kv_hold_timeout_s", self.kv_hold_timeout_s)
        if self.scheduler != "measured" and (self.slo_ttft_s is not None or self.slo_tpot_s is not None):
            raise ValueError("SLO targets need scheduler='measured'")
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        """The Engine's keyword arguments: EngineConfig's fields and SpeculativeConfig's, side by side."""
        spec_names = {f.name for f in fields(SpeculativeConfig)}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - names - spec_names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        spec = {k: kw.pop(k) for k in list(kw) if k in spec_names}
        if "speculative" in kw:                     # a whole SpeculativeConfig (its type checked in __post_init__)
            if spec:
                raise TypeError(f"give speculative=SpeculativeConfig(...) or its fields ({', '.join(sorted(spec))}) "
                                f"as keywords, not both")
            return cls(**kw)
        return cls(**kw, speculative=SpeculativeConfig(**spec))

    def check_unchunked(self, max_model_len: int) -> None:
        """The server's rule (as vLLM's): without chunked prefill a prompt runs in one step, so a step's budget must
        hold the longest one. (The engine itself still chunks a prompt over the budget rather than let it wait for
        ever: an Engine made without max_model_len, or a preempted request whose prompt and output outgrew it.)"""
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(f"with chunked prefill off, a prompt runs in one step: it needs max_num_batched_tokens "
                             f">= max_model_len ({self.max_num_batched_tokens} < {max_model_len}): raise "
                             "max_num_batched_tokens or lower max_model_len")

    def model_len(self, ctx_train: int) -> int:
        return ctx_train if self.max_model_len is None else self.max_model_len

    @staticmethod
    def add_cli_args(parser, *, only: tuple[str, ...] | None = None, defaults: dict | None = None,
                     title: str = "engine") -> None:
        """Add the engine's flags (CLI_ARGS; `only` these fields, in table order) to `parser` (an ArgumentParser:
        as a group of their own, titled `title`; or an argument group of the tool's). defaults: the tool's own
        defaults, by field (shown in --help)."""
        unknown = set(only or ()) - set(CLI_ARGS)
        if unknown:
            raise ValueError(f"no command-line flag for {sorted(unknown)}")
        group = parser.add_argument_group(title) if isinstance(parser, argparse.ArgumentParser) else parser
        for name, (flags, kw, text) in CLI_ARGS.items():
            if only is not None and name not in only:
                continue
            kw = dict(kw)
            default = (defaults or {}).get(name, kw.pop("default", None))
            if kw.get("action") not in ("store_true", "store_false"):
                kw["default"] = default
                text += "" if default is None else f" (default {default})"
            group.add_argument(*flags, dest=name, help=text, **kw)

    @classmethod
    def cli_options(cls, args: argparse.Namespace) -> dict:
        """The engine options set on the command line (add_cli_args' dests), as EngineConfig / Engine keywords:
        the SLO flags in milliseconds become seconds, --draft-quant none is None."""
        out = {}
        for name in CLI_ARGS:
            if hasattr(args, name):
                v = getattr(args, name)
                out[name] = v / 1e3 if name in ("slo_ttft_s", "slo_tpot_s") and v is not None else v
        if "draft_quant" in out:
            out["draft_quant"] = draft_quant_flag(out["draft_quant"])
        return out

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **fixed) -> "EngineConfig":
        """The config of a parsed command line; `fixed`: a tool's own choices (they win). ValueError names the
        flag of a bad value (or the field, for a tool's own choice)."""
        try:
            return cls.from_kwargs(**{**cls.cli_options(args), **fixed})
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            if name in ("slo_ttft_s", "slo_tpot_s") and name not in fixed:
                flag = CLI_ARGS[name][0][0]
                raise ValueError(f"{flag} must be a positive number of milliseconds, got {getattr(args, name)!r}") \
                    from None
            raise ValueError(cli_words(str(e))) from None


THREAD_FLAGS = ("threads", "adaptive_threads")     # what every tool that runs a model takes


def cli_words(message: str) -> str:
    """An engine error as a command-line user reads it: each option's field name (kv_cache_mb) as its flag
    (--kv-cache-mb)."""
    for name, (flags, _, _) in CLI_ARGS.items():
        if not flags[0].endswith("-ms") and flags[0].startswith("--") and name.replace("_", "-") == flags[0][2:]:
            message = re.sub(rf"(?<![\w-]){name}(?!\w)", flags[0], message)
    return message


# field -> (flags, argparse keywords, help): every engine option a command line may set, declared once.
CLI_ARGS: dict[str, tuple[tuple[str, ...], dict, str]] = {
    "threads": (("--threads", "-t"), dict(type=int, metavar="N"),
                "the most threads a step runs on (default: all cores); fewer while other processes want the cores"),
    "adaptive_threads": (("--fixed-threads",), dict(action="store_false"), "always run --threads threads"),
    "max_model_len": (("--max-model-len",), dict(type=int, metavar="TOKENS"),
                      "longest prompt + output in tokens (default: the model's trained context)"),
    "max_num_seqs": (("--max-num-seqs",), dict(type=int, default=16, metavar="N"), "requests running at once"),
    "max_num_batched_tokens": (("--max-num-batched-tokens",), dict(type=int, default=512, metavar="N"),
                               "the most tokens a step computes"),
    "kv_cache_mb": (("--kv-cache-mb",), dict(type=float, metavar="MB"),
                    "KV block pool size (default: min(1024, a fifth of the available memory))"),
    "enable_prefix_caching": (("--no-prefix-caching",), dict(action="store_false"), "turn prefix caching off"),
    "enable_chunked_prefill": (("--no-chunked-prefill",), dict(action="store_false"), "turn chunked prefill off"),
    "scheduler": (("--scheduler",), dict(choices=["paced", "fcfs", "measured"]),
                  "default: measured with an SLO target, else paced. paced: prompt chunks ride along with running streams only while a step stays within --pace times "
                  "a decode step's time; fcfs: a fixed token budget every step; measured: each step's budget from a "
                  "fitted model of this machine's step costs, for the SLO targets when given"),
    "pace": (("--pace",), dict(type=float, default=1.5, metavar="X"),
             "paced scheduler: the most a step with prompt tokens may take, in decode steps' time"),
    "slo_ttft_s": (("--slo-ttft-ms",), dict(type=float, metavar="MS"),
                   "time-to-first-token target (the measured scheduler works to it)"),
    "slo_tpot_s": (("--slo-tpot-ms",), dict(type=float, metavar="MS"),
                   "mean time-per-output-token target (the measured scheduler works to it)"),
    "explain": (("--explain",), dict(action="store_true"), "log every step's scheduling decision"),
    "draft_model": (("--draft-model",), dict(metavar="MODEL"),
                    "a model sharing the target's vocabulary, for speculative decoding with a draft"),
    "num_speculative_tokens": (("--num-speculative-tokens",), dict(type=int, default=5, metavar="K"),
                               "most tokens drafted per step"),
    "ngram_min": (("--ngram-min",), dict(type=int, default=1, metavar="N"), "shortest n-gram the lookup matches"),
    "ngram_max": (("--ngram-max",), dict(type=int, default=4, metavar="N"), "longest n-gram the lookup matches"),
    "draft_vocab": (("--draft-vocab",), dict(type=int, default=32768, metavar="N"),
                    "the draft model proposes only the first N token ids (its output head reads that share; "
                    "N past the vocabulary: all of it)"),
    "draft_quant": (("--draft-quant",), dict(choices=DRAFT_QUANT_FLAGS, default="q4_0"),
                    "the draft model's matrices stored in more bits per weight are requantized to Q4_0 as it "
                    "loads (none: as stored)"),
}


def available_mb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def kv_blocks(cfg: EngineConfig, bytes_per_block: int) -> int:
    """The KV pool's size in blocks: num_kv_blocks, else kv_cache_mb (default: min(1024 MB, a fifth of the
    available memory)) over the bytes of one block."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    mb = cfg.kv_cache_mb
    if mb is None:
        avail = available_mb()
        mb = DEFAULT_KV_CACHE_MB if avail is None else min(DEFAULT_KV_CACHE_MB, avail / 5)
    n = int(mb * 2 ** 20 // bytes_per_block)
    if n < 1:
        raise ValueError(f"kv_cache_mb={mb} holds no block ({bytes_per_block} bytes each)")
    return n
