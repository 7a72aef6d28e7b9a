"""Data pipeline throughput: prepare-data (MB/s, tokens/s; 1 and 2 workers), the loader (batches/s), and a 3-source
mixture against one source of the same total size (windows/s, paired in the same run).

    python benchmarks/data_bench.py --mb 32 --repeats 5 --tokenizer bpe

The corpus is the built-in one repeated to --mb megabytes of JSONL; 'bpe' trains a 8192-token byte-level BPE on the
built-in corpus first (any tokenizer spec works too). Every figure is the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

from titan_npu.config.schema import DataSource, JobConfig
from titan_npu.data import build_dataloader, build_tokenizer
from titan_npu.data.prepare import prepare
from titan_npu.data.progress import Progress
from titan_npu.data.sources import builtin_corpus_path, iter_documents
from titan_npu.data.train_tokenizer import train_bpe


def make_corpus(folder: Path, megabytes: float, name: str = "corpus") -> Path:
    """The built-in corpus repeated into one JSONL file of about `megabytes` MB."""
    lines = [json.dumps({"text": d}) + "\n" for d in iter_documents([builtin_corpus_path()])]
    target, size, i = megabytes * 1e6, 0, 0
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            line = lines[i % len(lines)]
            f.write(line)
            size += len(line.encode())
            i += 1
    return path


def bench_prepare(corpus: Path, tokenizer: str, workers: int, repeats: int, work: Path) -> dict:
    mbs, tps = [], []
    for r in range(repeats):
        out = work / f"shards_w{workers}_{r}"
        start = time.perf_counter()
        result = prepare([str(corpus)], out, tokenizer=tokenizer, workers=workers,
                         progress=Progress(1, stream=io.StringIO()))
        seconds = time.perf_counter() - start
        mbs.append(result.input_bytes / seconds / 1e6)
        tps.append(result.num_tokens / seconds)
    return {"workers": workers, "MB/s": statistics.median(mbs), "tokens/s": statistics.median(tps),
            "tokens": result.num_tokens, "output": str(work / f"shards_w{workers}_0")}


def bench_loader(shards: str, tokenizer: str, num_workers: int, batch_size: int, seq_len: int, batches: int,
                 repeats: int) -> dict:
    cfg = JobConfig()
    cfg.data.path, cfg.data.num_workers = shards, num_workers
    cfg.training.batch_size, cfg.training.seq_len = batch_size, seq_len
    tok = build_tokenizer(tokenizer)
    rates = []
    for _ in range(repeats):
        loader = build_dataloader(cfg, tok, 0, 1)
        next(loader)  # start-up (worker processes, first map) is not steady-state throughput
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        rates.append(batches / (time.perf_counter() - start))
        loader.close()
    return {"num_workers": num_workers, "batches/s": statistics.median(rates),
            "tokens/s": statistics.median(rates) * batch_size * seq_len}


MIX = (("web", 0.6), ("code", 0.3), ("math", 0.1))


def bench_mixture(single: str, work: Path, megabytes: float, tokenizer: str, batch_size: int, seq_len: int,
                  batches: int, repeats: int) -> dict:
    """Windows/s of a 3-source mixture (0.6/0.3/0.1 of the corpus, weighted alike) and of one source of the same total
    size, read in alternation (paired: the same machine state), in the training process (num_workers 0), where any
    cost of mixing would show."""
    sources = []
    for name, share in MIX:
        corpus = make_corpus(work / f"mix_{name}", megabytes * share, name)
        prepare([str(corpus)], work / f"mix_{name}" / "shards", tokenizer=tokenizer, workers=1,
                progress=Progress(1, stream=io.StringIO()))
        sources.append((name, share, str(work / f"mix_{name}" / "shards")))
    tok = build_tokenizer(tokenizer)

    def config(mixture: bool) -> JobConfig:
        cfg = JobConfig()
        cfg.data.num_workers = 0
        cfg.training.batch_size, cfg.training.seq_len = batch_size, seq_len
        if mixture:
            cfg.data.sources = [DataSource(name=n, path=p, weight=w) for n, w, p in sources]
        else:
            cfg.data.path = single
        return cfg

    def rate(cfg: JobConfig) -> float:
        loader = build_dataloader(cfg, tok, 0, 1)
        next(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(loader)
        return batches * batch_size / (time.perf_counter() - start)

    pairs = [(rate(config(False)), rate(config(True))) for _ in range(repeats)]
    return {"single": statistics.median(p[0] for p in pairs), "mixture": statistics.median(p[1] for p in pairs),
            "ratio": statistics.median(m / s for s, m in pairs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=32.0, help="corpus size in MB of JSONL")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokenizer", default="bpe", help="'bpe' (trained here), 'byte' or a tokenizer path")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batches", type=int, default=200)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = args.tokenizer
        if tokenizer == "bpe":
            tokenizer = str(train_bpe([str(builtin_corpus_path())], 8192, work / "bpe"))
        corpus = make_corpus(work, args.mb)
        print(f"corpus {corpus.stat().st_size / 1e6:.1f} MB JSONL, tokenizer {args.tokenizer}, "
              f"median of {args.repeats} runs")
        print("| prepare-data | MB/s | tokens/s |\n|---|---|---|")
        prepared = []
        for workers in (1, 2):
            r = bench_prepare(corpus, tokenizer, workers, args.repeats, work)
            prepared.append(r)
            print(f"| --workers {workers} | {r['MB/s']:.1f} | {r['tokens/s']:,.0f} |")
        print(f"\n| loader (batch {args.batch_size} x seq {args.seq_len}) | batches/s | tokens/s |\n|---|---|---|")
        for num_workers in (0, 2):
            r = bench_loader(prepared[0]["output"], tokenizer, num_workers, args.batch_size, args.seq_len,
                             args.batches, args.repeats)
            print(f"| num_workers {num_workers} | {r['batches/s']:.0f} | {r['tokens/s']:,.0f} |")
        r = bench_mixture(prepared[0]["output"], work, args.mb, tokenizer, args.batch_size, args.seq_len,
                          args.batches, args.repeats)
        print(f"\n| mixture (batch {args.batch_size} x seq {args.seq_len}, num_workers 0) | windows/s |\n|---|---|")
        print(f"| one source, {args.mb:g} MB | {r['single']:,.0f} |")
        print(f"| 3 sources (0.6/0.3/0.1), same total | {r['mixture']:,.0f} |")
        print(f"| mixture / one source (median of paired runs) | {r['ratio']:.3f}x |")


if __name__ == "__main__":
    main()
