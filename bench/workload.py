"""Workloads: the prompts a sweep sends, with exact token lengths.

    preset name | length specs | ShareGPT file  -> WorkloadSpec
    WorkloadSpec + the served model's tokenizer -> build_requests() -> [WorkRequest]
        synthetic: lengths drawn from the spec's distributions, each prompt a slice
          of real English text (the docstrings of a fixed list of stdlib modules),
          adjusted until the tokenizer gives exactly the drawn length
        ShareGPT: first human turn = prompt, the reply's token count = output length

Output lengths are fixed by the request (max_tokens with ignore_eos), so every
request costs what the workload says, on every system.
Length specs: "128", "uniform:LO:HI", "normal:MEAN:STD", "lognormal:MEAN:STD"
(mean and std of the length itself), clipped to [1, max].
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import math
import pathlib
import warnings
from typing import Any

import numpy as np

# Real text that every Python install carries: module and API docstrings.
CORPUS_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
                  "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
                  "inspect", "itertools", "json", "logging", "pathlib", "pickle", "random", "re", "shutil",
                  "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
                  "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile")


class WorkloadError(ValueError):
    """A bad preset, length spec or dataset file."""


@dataclasses.dataclass(frozen=True)
class LengthDist:
    kind: str            # const | uniform | normal | lognormal
    a: float
    b: float = 0.0

    def mean(self) -> float:
        return {"const": self.a, "uniform": (self.a + self.b) / 2}.get(self.kind, self.a)

    def sample(self, rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
        if self.kind == "const":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b, size=n)
        else:  # lognormal with the given mean and std of the length
            sigma2 = math.log(1.0 + (self.b / self.a) ** 2)
            x = rng.lognormal(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2), size=n)
        return np.clip(np.rint(x), lo, hi).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "const":
            return str(int(self.a))
        return f"{self.kind}:{_fmt(self.a)}:{_fmt(self.b)}"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def parse_length(spec: str | int) -> LengthDist:
    """'128' | 'uniform:64:192' | 'normal:1019:300' | 'lognormal:1019:900' -> LengthDist."""
    s = str(spec).strip()
    parts = s.split(":")
    try:
        if len(parts) == 1:
            v = float(parts[0])
            if v < 1:
                raise WorkloadError(f"length '{s}' must be >= 1")
            return LengthDist("const", v)
        kind, nums = parts[0].lower(), [float(p) for p in parts[1:]]
    except ValueError:
        raise WorkloadError(f"bad length spec '{s}': expected N, uniform:LO:HI, normal:MEAN:STD "
                            f"or lognormal:MEAN:STD") from None
    if kind not in ("uniform", "normal", "lognormal") or len(nums) != 2:
        raise WorkloadError(f"bad length spec '{s}': expected N, uniform:LO:HI, normal:MEAN:STD "
                            f"or lognormal:MEAN:STD")
    a, b = nums
    if kind == "uniform" and not 1 <= a <= b:
        raise WorkloadError(f"bad length spec '{s}': need 1 <= LO <= HI")
    if kind in ("normal", "lognormal") and not (a >= 1 and b >= 0):
        raise WorkloadError(f"bad length spec '{s}': need MEAN >= 1 and STD >= 0")
    if kind == "lognormal" and b == 0:
        return LengthDist("const", a)
    return LengthDist(kind, a, b)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What to send: length distributions (or a dataset file), bounds, seed."""
    name: str
    input_len: LengthDist
    output_len: LengthDist
    max_input_len: int = 4096
    max_output_len: int = 2048
    dataset_path: str | None = None     # ShareGPT JSON/JSONL; overrides the synthetic lengths
    seed: int = 0

    def describe(self) -> dict:
        d = {"name": self.name, "input_len": str(self.input_len), "output_len": str(self.output_len),
             "max_input_len": self.max_input_len, "max_output_len": self.max_output_len, "seed": self.seed}
        if self.dataset_path:
            d["dataset_path"] = self.dataset_path
        return d


# Presets. The paper's ShareGPT v3 workload has mean 1019 input / 463 output tokens
# with a long tail (lognormal here); the scaled ones keep its shape at CPU sizes.
PRESETS: dict[str, dict[str, Any]] = {
    "sharegpt": {"input": "lognormal:1019:900", "output": "lognormal:463:400", "max_in": 4096, "max_out": 2048},
    "sharegpt-small": {"input": "lognormal:128:112", "output": "lognormal:58:50", "max_in": 1024, "max_out": 512},
    "cpu2": {"input": "uniform:64:192", "output": "128", "max_in": 512, "max_out": 128},
    "smoke": {"input": "16", "output": "8", "max_in": 64, "max_out": 16},
}


def spec_from_args(preset: str | None, input_len: str | None, output_len: str | None,
                   dataset: str | None, seed: int) -> WorkloadSpec:
    """A preset with optional overrides, or explicit lengths, or a dataset file."""
    base = PRESETS.get(preset or "cpu2")
    if base is None:
        raise WorkloadError(f"unknown workload preset '{preset}' (choose from {', '.join(PRESETS)})")
    inp = parse_length(input_len or base["input"])
    out = parse_length(output_len or base["output"])
    max_in = max(base["max_in"], int(math.ceil(_upper(inp))))
    max_out = max(base["max_out"], int(math.ceil(_upper(out))))
    name = preset or "cpu2"
    if input_len or output_len:
        name = f"{name}(in={inp},out={out})"
    if dataset:
        if not pathlib.Path(dataset).is_file():
            raise WorkloadError(f"dataset {dataset}: no such file")
        name = f"sharegpt-file:{pathlib.Path(dataset).name}"
    return WorkloadSpec(name, inp, out, max_in, max_out, dataset, seed)


def _upper(d: LengthDist) -> float:
    return d.b if d.kind == "uniform" else d.a


@dataclasses.dataclass(frozen=True)
class WorkRequest:
    prompt: str
    prompt_tokens: int       # exact, by the served model's tokenizer (special tokens included)
    output_tokens: int       # max_tokens, sent with ignore_eos


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """Docstrings of CORPUS_MODULES and their public members, in a fixed order."""
    chunks: list[str] = []
    for name in CORPUS_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():   # typing.io / typing.re warn when touched
                warnings.simplefilter("ignore")
                obj = getattr(mod, attr, None)
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    docs.append(inspect.getdoc(obj) or "")
        chunks += [d for d in docs if len(d) > 40]
    return "\n\n".join(chunks)


class PromptMaker:
    """Cuts prompts of an exact token length out of the corpus.

    `tokenizer` is a dpu_frontend ModelTokenizer (encode(text, add_special_tokens) -> ids,
    decode(ids, skip_special_tokens) -> text).
    """

    def __init__(self, tokenizer, text: str | None = None):
        self.tok = tokenizer
        self.corpus_ids: list[int] = tokenizer.encode(text or corpus_text(), add_special_tokens=False)
        if len(self.corpus_ids) < 1000:
            raise WorkloadError("the prompt corpus is too small")
        self.special = len(tokenizer.encode("a", add_special_tokens=True)) - len(
            tokenizer.encode("a", add_special_tokens=False))

    def make(self, n: int, rng: np.random.Generator, tries: int = 12) -> tuple[str, int]:
        """(text, its exact length) with the length n whenever the tokenizer allows it."""
        body = max(1, n - self.special)
        start = int(rng.integers(0, max(1, len(self.corpus_ids) - body - 64)))
        ids = self.corpus_ids[start:start + body]
        extra = start + body
        best: tuple[str, int] | None = None
        for _ in range(tries):
            text = self.tok.decode(ids, skip_special_tokens=False)
            got = len(self.tok.encode(text, add_special_tokens=True))
            if best is None or abs(got - n) < abs(best[1] - n):
                best = (text, got)
            if got == n:
                return text, got
            canon = self.tok.encode(text, add_special_tokens=False)
            want = n - self.special
            if len(canon) > want:
                ids = canon[:want]
            else:
                need = want - len(canon)
                ids = canon + self.corpus_ids[extra:extra + need]
                extra += need
                if extra >= len(self.corpus_ids):
                    extra = 0
        return best


def build_requests(spec: WorkloadSpec, tokenizer, count: int) -> list[WorkRequest]:
    """`count` requests for the spec, deterministic for a given seed."""
    if count < 1:
        raise WorkloadError("need at least one request")
    rng = np.random.default_rng(spec.seed)
    if spec.dataset_path:
        return _from_sharegpt(spec, tokenizer, count, rng)
    maker = PromptMaker(tokenizer)
    ins = spec.input_len.sample(rng, count, max(1, maker.special + 1), spec.max_input_len)
    outs = spec.output_len.sample(rng, count, 1, spec.max_output_len)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        text, got = maker.make(int(n_in), rng)
        reqs.append(WorkRequest(text, got, int(n_out)))
    return reqs


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first human turn, the reply) pairs from a ShareGPT JSON list or JSONL file."""
    p = pathlib.Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"dataset {path}: cannot read ({e})") from None
    try:
        data = json.loads(raw)
        rows = data if isinstance(data, list) else [data]
    except ValueError:
        try:
            rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
        except ValueError as e:
            raise WorkloadError(f"dataset {path}: neither a JSON list nor JSONL ({e})") from None
    pairs = []
    for row in rows:
        turns = row.get("conversations") or row.get("messages") if isinstance(row, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        q = first.get("value", first.get("content"))
        a = second.get("value", second.get("content"))
        if isinstance(q, str) and isinstance(a, str) and q.strip() and a.strip():
            pairs.append((q, a))
    if not pairs:
        raise WorkloadError(f"dataset {path}: no ShareGPT conversations (need 'conversations' "
                            f"or 'messages' with at least two turns)")
    return pairs


def _from_sharegpt(spec: WorkloadSpec, tokenizer, count: int, rng: np.random.Generator) -> list[WorkRequest]:
    pairs = load_sharegpt(spec.dataset_path)
    order = rng.permutation(len(pairs))
    reqs: list[WorkRequest] = []
    for i in order:
        prompt, reply = pairs[int(i)]
        n_in = len(tokenizer.encode(prompt, add_special_tokens=True))
        n_out = len(tokenizer.encode(reply, add_special_tokens=False))
        # vLLM's ShareGPT filter: drop tiny and over-long pairs.
        if n_in < 4 or n_out < 4 or n_in > spec.max_input_len or n_out > spec.max_output_len:
            continue
        reqs.append(WorkRequest(prompt, n_in, n_out))
        if len(reqs) == count:
            break
    if not reqs:
        raise WorkloadError(f"dataset {spec.dataset_path}: no conversation fits the length limits "
                            f"(input <= {spec.max_input_len}, output <= {spec.max_output_len})")
    while len(reqs) < count:  # a small file is cycled
        reqs.append(reqs[len(reqs) % max(1, len(reqs))])
    return reqs


def load_tokenizer(model: str):
    """The served model's tokenizer, through dpu_frontend (HF folder, GGUF or 'default')."""
    from dpu_frontend.tokenizer import TokenizerError, load_tokenizer as _load
    try:
        return _load(model)
    except TokenizerError as e:
        raise WorkloadError(str(e)) from None
