"""Parsing what llama.cpp's native tools print: llama-bench, llama-batched-bench, llama-simple.

Pure functions of the text, so they are tested without llama.cpp. Formats (llama.cpp as
vendored by llama-cpp-python 0.3.x):

- ``llama-bench -o json``: a JSON list, one object per test with ``n_prompt``, ``n_gen``,
  ``n_depth``, ``n_threads``, ``avg_ts`` and ``samples_ts`` (tokens/s per repetition);
  ``-o jsonl`` is one such object per line; the default markdown table has a ``test`` column
  (``pp512``, ``tg128``, ``pp512+tg128``, ``tg128 @ d8192``) and ``t/s`` as ``avg ± stddev``.
- ``llama-batched-bench``: a markdown table ``| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s
  | S_TG t/s | T s | S t/s |`` or, with ``--output-format jsonl``, one object per row with
  ``pp``, ``tg``, ``pl``, ``speed_tg`` ...
- ``llama-simple``: the prompt's pieces then the generated pieces on stdout, no separator.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchTest:
    """One llama-bench test: tokens/s over its repetitions."""

    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float
    samples_ts: tuple[float, ...] = ()
    n_threads: int | None = None

    @property
    def name(self) -> str:
        kind = (f"pp{self.n_prompt}" if not self.n_gen else f"tg{self.n_gen}" if not self.n_prompt
                else f"pp{self.n_prompt}+tg{self.n_gen}")
        return kind + (f" @ d{self.n_depth}" if self.n_depth else "")


@dataclass(frozen=True)
class BatchedRow:
    """One llama-batched-bench row: B sequences, PP prompt and TG generated tokens each."""

    pp: int
    tg: int
    b: int
    s_pp: float  # prompt tokens/s
    s_tg: float  # generated tokens/s, all B sequences together
    s: float  # everything/s


def _bench_from_dict(d: dict) -> BenchTest:
    samples = tuple(float(x) for x in d.get("samples_ts") or ())
    threads = d.get("n_threads")
    return BenchTest(int(d["n_prompt"]), int(d["n_gen"]), int(d.get("n_depth", 0)),
                     float(d["avg_ts"]), samples, int(threads) if threads is not None else None)


def _table_rows(text: str) -> list[list[str]]:
    """Cells of every markdown table line, separator lines dropped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")):
            continue
        cells = [c.strip() for c in line[1:-1].split("|")]
        if all(re.fullmatch(r":?-+:?", c) for c in cells if c):
            continue
        rows.append(cells)
    return rows


_TEST = re.compile(r"(?:pp(\d+))?\+?(?:tg(\d+))?(?: @ d(\d+))?")


def _bench_from_markdown(text: str) -> list[BenchTest]:
    rows = _table_rows(text)
    if not rows:
        return []
    header = [h.lower() for h in rows[0]]
    test_col, ts_col = header.index("test"), header.index("t/s")
    threads_col = header.index("threads") if "threads" in header else None
    out = []
    for cells in rows[1:]:
        m = _TEST.fullmatch(cells[test_col])
        if not m or not (m.group(1) or m.group(2)):
            raise ValueError(f"unrecognised llama-bench test {cells[test_col]!r}")
        avg = float(cells[ts_col].split("±")[0])
        threads = int(cells[threads_col]) if threads_col is not None else None
        out.append(BenchTest(int(m.group(1) or 0), int(m.group(2) or 0), int(m.group(3) or 0),
                             avg, (), threads))
    return out


def parse_llama_bench(text: str) -> list[BenchTest]:
    """Every test in llama-bench output: JSON (``-o json``), JSONL or the markdown table."""
    start = text.lstrip()[:1]
    if start == "[":
        return [_bench_from_dict(d) for d in json.loads(text)]
    if start == "{":
        return [_bench_from_dict(json.loads(line)) for line in text.splitlines()
                if line.strip().startswith("{")]
    return _bench_from_markdown(text)


def parse_batched_bench(text: str) -> list[BatchedRow]:
    """Every row of llama-batched-bench output (markdown table or ``--output-format jsonl``).

    Other lines (the tool's log, the parameter line) are skipped.
    """
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            d = json.loads(line)
            out.append(BatchedRow(int(d["pp"]), int(d["tg"]), int(d["pl"]),
                                  float(d["speed_pp"]), float(d["speed_tg"]), float(d["speed"])))
    if out:
        return out
    rows = _table_rows(text)
    header = [h.split()[0].upper() for h in rows[0]] if rows else []
    if "S_TG" not in header:
        return []
    col = {name: header.index(name) for name in ("PP", "TG", "B", "S_PP", "S_TG", "S")}
    for cells in rows[1:]:
        if len(cells) != len(header):
            continue
        out.append(BatchedRow(int(cells[col["PP"]]), int(cells[col["TG"]]), int(cells[col["B"]]),
                              float(cells[col["S_PP"]]), float(cells[col["S_TG"]]),
                              float(cells[col["S"]])))
    return out


def parse_simple_tokens(stdout: str, prompt: str, vocab: list[str]) -> list[int]:
    """Generated token ids from llama-simple's stdout, for a vocabulary of one-character tokens.

    The tool prints ``<s>`` (BOS), the prompt, then one piece per generated token. Parsing stops
    at the first piece that is not a one-character token (a byte token or a special), where
    the id cannot be recovered from the text; -1 marks that point.
    """
    text = stdout.rstrip("\n")
    head = text.find(prompt)
    if head < 0:
        raise ValueError("llama-simple output does not contain the prompt")
    index = {tok: i for i, tok in enumerate(vocab) if len(tok) == 1}
    out = []
    for ch in text[head + len(prompt):]:
        if ch not in index:
            out.append(-1)
            break
        out.append(index[ch])
    return out
