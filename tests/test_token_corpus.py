"""Tokenized corpora from disk (runtime/token_files.py, TokenCorpus) and `malleus prepare-data`.

Megatron files are checked against the layout written out by hand here, not only against our own
writer; every bad file is refused with one line before a token is read.
"""
from __future__ import annotations

import json
import struct
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from malleus_svc.cli import main
from malleus_svc.config.errors import ConfigError
from malleus_svc.config.job import JobConfig
from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime.data import DataError, GlobalSampler, split_for_plan
from malleus_svc.runtime.datasets import TokenCorpus, build_dataset
from malleus_svc.runtime.token_files import IndexedWriter, open_indexed, open_plain

pytest.importorskip("tokenizers")
pytest.importorskip("datasets")


def write_docs(prefix: Path, docs: list[np.ndarray], dtype: str = "uint16") -> Path:
    w = IndexedWriter(prefix, dtype)
    w.add(np.concatenate(docs) if docs else np.zeros(0), np.array([len(d) for d in docs]))
    w.close()
    return prefix


def random_docs(seed: int, n: int, vocab: int = 300, longest: int = 90) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(k)) for k in rng.integers(1, longest, size=n)]


def corpus(files, seq_len=16, vocab=512, seed=0) -> TokenCorpus:
    return build_dataset({"source": "tokens", "seq_len": seq_len, "vocab": vocab, "seed": seed,
                          "files": [f if isinstance(f, dict) else {"path": str(f)} for f in files]})


# ------------------------------------------------------------------------------------- formats
def test_a_megatron_index_written_by_hand_to_its_layout_is_read():
    """The layout as Megatron documents it: magic, version, dtype code, counts, lengths, pointers, doc indices."""
    import tempfile

    docs = [np.array([5, 6, 7], np.int32), np.array([1], np.int32), np.array([9, 9, 9, 9, 2], np.int32)]
    d = Path(tempfile.mkdtemp())
    (d / "m.bin").write_bytes(b"".join(x.tobytes() for x in docs))
    lengths = np.array([3, 1, 5], np.int32)
    pointers = np.array([0, 12, 16], np.int64)
    (d / "m.idx").write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4) + struct.pack("<Q", 3)
                              + struct.pack("<Q", 4) + lengths.tobytes() + pointers.tobytes()
                              + np.arange(4, dtype=np.int64).tobytes())
    f = open_indexed(d / "m")
    assert f.dtype == np.int32 and list(f.lengths) == [3, 1, 5] and f.tokens == 9
    assert [list(f.ids(int(s), int(n))) for s, n in zip(f.starts, f.lengths)] == [list(x) for x in docs]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30), seq_len=st.integers(2, 40))
def test_every_next_token_target_is_trained_exactly_once(tmp_path_factory, seed, n, seq_len):
    docs = random_docs(seed, n) + [np.array([7, 8])]   # at least one trainable document
    c = corpus([write_docs(tmp_path_factory.mktemp("c") / "a", docs)], seq_len=seq_len)
    pieces: dict[int, list] = {}
    for i in range(len(c)):
        x = c[i].numpy()
        assert 2 <= len(x) <= seq_len + 1 and len(x) == c.lengths[i]
        pieces.setdefault(c.document_of(i)[1], []).append(x)
    assert sorted(pieces) == [k for k, d in enumerate(docs) if len(d) >= 2]
    for k, ps in pieces.items():
        # pieces overlap by one token: input/target pairs of all pieces == those of the document
        pairs = [(int(a), int(b)) for p in ps for a, b in zip(p[:-1], p[1:])]
        assert pairs == list(zip(docs[k][:-1].tolist(), docs[k][1:].tolist()))


def test_plain_bins_with_and_without_document_offsets(tmp_path):
    ids = np.arange(100, dtype=np.uint32) % 97
    ids.tofile(tmp_path / "p.bin")
    np.save(tmp_path / "p.npy", np.array([0, 10, 60]))
    f = open_plain(tmp_path / "p.bin", "uint32", tmp_path / "p.npy")
    assert list(f.lengths) == [10, 50, 40] and list(f.ids(60, 3)) == [60, 61, 62]
    stream = open_plain(tmp_path / "p.bin", "uint32")
    assert list(stream.lengths) == [100]
    c = corpus([{"path": str(tmp_path / "p.bin"), "dtype": "uint32"}], seq_len=9)
    assert len(c) == 11 and list(c[0].numpy()) == list(range(10)) and list(c[1][:2].numpy()) == [9, 10]


def test_blend_weights_repeat_or_subsample_files_the_same_way_each_time(tmp_path):
    a = write_docs(tmp_path / "a", random_docs(1, 40, longest=10))
    b = write_docs(tmp_path / "b", random_docs(2, 40, longest=10))
    c = corpus([{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 0.5}], seq_len=64)
    by_file = Counter(c.document_of(i) for i in range(len(c)))
    n_a = sum(1 for k in by_file if k[0] == 0)
    assert n_a == 40 - sum(len(d) < 2 for d in random_docs(1, 40, longest=10))
    assert all(v == 2 for k, v in by_file.items() if k[0] == 0)
    assert all(v == 1 for k, v in by_file.items() if k[0] == 1)
    assert sum(1 for k in by_file if k[0] == 1) == round(0.5 * sum(len(d) >= 2 for d in random_docs(2, 40, longest=10)))
    again = corpus([{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 0.5}], seq_len=64)
    other = corpus([{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 0.5}], seq_len=64, seed=1)
    assert [again.document_of(i) for i in range(len(c))] == [c.document_of(i) for i in range(len(c))]
    assert [other.document_of(i) for i in range(len(c))] != [c.document_of(i) for i in range(len(c))]
    shares = [f["share"] for f in c.describe()["files"]]
    assert shares[0] > 0.75 and abs(sum(shares) - 1) < 1e-9


def test_every_document_once_per_epoch_across_a_plan_change_and_a_resume(tmp_path):
    """Over every epoch, each sample (so each piece of every document) trains exactly once, although
    the corpus is no multiple of either global batch, the plan changes the batch mid-epoch and the
    sampler resumes from its saved state in a fresh sampler mid-epoch too."""
    docs = random_docs(3, 60, longest=40)
    c = corpus([write_docs(tmp_path / "a", docs)], seq_len=16)
    n = len(c)
    plans = [Plan(num_devices=2, num_layers=2, micro_batch_size=2, gpus_per_node=2,
                  pipelines=(Pipeline((Stage((0,), (0, 2)),), m0), Pipeline((Stage((1,), (0, 2)),), m1)))
             for m0, m1 in ((3, 2), (2, 4))]   # global batches 10 and 12
    assert n % 10 and n % 12, n
    sampler = GlobalSampler(n, plans[0].global_batch, seed=4)
    stream: list[int] = []
    step = 0
    while len(stream) < 3 * n:
        if step == n // 10 + 3:   # in the second epoch: resume from the saved state in a fresh sampler
            state = sampler.state_dict()
            assert state["position"] // n == 1 and state["position"] % n, state
            sampler = GlobalSampler(n, 1, seed=4)
            sampler.load_state_dict(state)
        plan = plans[step >= n // 20]   # the global batch changes in the first epoch
        stream += [i for pipe in split_for_plan(sampler.next_global_batch(plan.global_batch), plan)
                   for mb in pipe for i in mb]
        step += 1
    expected = Counter(c.document_of(i) for i in range(n))
    assert len(expected) == sum(len(d) >= 2 for d in docs)
    for e in range(3):
        epoch = stream[e * n:(e + 1) * n]
        assert sorted(epoch) == list(range(n)), f"epoch {e}"
        assert Counter(c.document_of(i) for i in epoch) == expected


# ------------------------------------------------------------------------------------- bad input
def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    return text


def test_truncated_or_mismatched_files_are_refused_with_what_is_wrong(tmp_path):
    prefix = write_docs(tmp_path / "a", random_docs(4, 10))
    good_idx, good_bin = Path(f"{prefix}.idx").read_bytes(), Path(f"{prefix}.bin").read_bytes()
    cases = [
        (good_idx[:-5], good_bin, "truncated"),
        (good_idx[:20], good_bin, "shorter than"),
        (b"NOTANIDX\x00" + good_idx[9:], good_bin, "starts with"),
        (good_idx, good_bin[:-2], "does not match"),
        (good_idx, good_bin + b"\x00\x00", "does not match"),
        (good_idx[:17] + bytes([6]) + good_idx[18:], good_bin, "dtype code 6"),
        (good_idx[:9] + struct.pack("<Q", 2) + good_idx[17:], good_bin, "version 2"),
    ]
    for idx, bin_, words in cases:
        Path(f"{prefix}.idx").write_bytes(idx)
        Path(f"{prefix}.bin").write_bytes(bin_)
        with pytest.raises(DataError) as e:
            corpus([prefix])
        assert words in one_line(e)
    Path(f"{prefix}.idx").write_bytes(good_idx)
    Path(f"{prefix}.bin").write_bytes(good_bin)
    assert len(corpus([prefix])) > 0


def test_ids_beyond_the_vocabulary_an_empty_corpus_and_bad_weights_are_refused(tmp_path):
    big = write_docs(tmp_path / "big", [np.array([1, 2, 700, 3])])
    with pytest.raises(DataError) as e:
        corpus([big], vocab=512)
    assert "token id 700" in one_line(e) and "vocab 512" in str(e.value)
    tiny = write_docs(tmp_path / "tiny", [np.array([1]), np.array([2])])
    with pytest.raises(DataError) as e:
        corpus([tiny])
    assert "no document of 2 tokens" in one_line(e)
    empty = write_docs(tmp_path / "empty", [])
    with pytest.raises(DataError) as e:
        corpus([empty])
    assert "no document of 2 tokens" in one_line(e)
    with pytest.raises(DataError) as e:
        corpus([{"path": str(big), "weight": 0.0}])
    assert "positive" in one_line(e)
    with pytest.raises(DataError) as e:
        corpus([tmp_path / "missing"])
    assert "neither" in one_line(e)
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError) as e:
        corpus([{"path": str(tmp_path / "odd.bin")}])
    assert "not a whole number of uint16" in one_line(e)


JOB = {"name": "t", "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_memory_mb": 16000},
       "model": {"layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 512, "seq_len": 64},
       "parallel": {"dp": 2, "tp": 1, "pp": 1}, "batch": {"global": 4, "micro": 2}}


@pytest.mark.parametrize("data, field", [
    ({"source": "tokens"}, "data.files"),
    ({"source": "tokens", "files": []}, "data.files"),
    ({"source": "tokens", "files": [{"path": "x", "weight": -1}]}, "data.files[0].weight"),
    ({"source": "tokens", "files": [{"path": "x", "dtype": "int8"}]}, "data.files[0].dtype"),
    ({"source": "tokens", "files": [{"path": "x", "wieght": 2}]}, "data.files[0].wieght"),
    ({"source": "tokens", "files": ["x"], "num_samples": 10}, "data.num_samples"),
    ({"source": "tokens", "files": ["x"], "vocab": 1000}, "data.vocab"),
])
def test_the_job_file_names_the_bad_field(data, field):
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict({**JOB, "data": data}, source="job.yaml")
    assert e.value.field == field, str(e.value)


def test_the_job_file_spec_builds_the_corpus(tmp_path):
    prefix = write_docs(tmp_path / "a", random_docs(5, 20))
    job = JobConfig.from_dict({**JOB, "data": {"source": "tokens", "seq_len": 32, "files": [str(prefix)]}})
    c = build_dataset(job.data.spec())
    assert isinstance(c, TokenCorpus) and c.vocab == 512 and c.seq_len == 32


def test_a_job_on_a_truncated_index_stops_in_one_line_before_ray_starts(tmp_path):
    """`python -m malleus_svc.train` checks the corpus before Ray: the Ray address given is unreachable,
    so getting as far as Ray would end otherwise than in this one line."""
    import subprocess
    import sys

    prefix = write_docs(tmp_path / "a", random_docs(6, 20))
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes()[:-5])
    job = {**JOB, "data": {"source": "tokens", "seq_len": 32, "files": [str(prefix)]}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    r = subprocess.run([sys.executable, "-m", "malleus_svc.train", str(tmp_path / "job.json"), "--steps", "1",
                        "--address", "127.0.0.1:1", "--no-metrics"], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: data: ") and "truncated" in r.stderr, r.stderr
    assert str(idx) in r.stderr and r.stdout == ""


def test_the_driver_scans_a_file_without_summary_once_and_the_workers_not_at_all(tmp_path, monkeypatch):
    """`WorkerGroup.set_data` (its data path alone; three stand-in workers build the dataset from what
    they are sent): one scan per file on the driver, none on workers, and a file whose too-large id
    only a scan finds is refused on the driver before any worker is asked."""
    from malleus_svc.runtime.cluster import WorkerGroup
    from malleus_svc.runtime.token_files import TokenFile

    scans: list = []
    real_max_id = TokenFile.max_id
    monkeypatch.setattr(TokenFile, "max_id", lambda self: scans.append(self.path) or real_max_id(self))
    docs_a, docs_b = random_docs(6, 30), random_docs(7, 30)
    a, b = write_docs(tmp_path / "a", docs_a), write_docs(tmp_path / "b", docs_b)   # no summary beside them
    sent: list = []

    def workers(method, spec, mode, seq_len, devices=None):
        sent.append(spec)
        return [len(build_dataset(spec)) for _ in range(3)]

    group = object.__new__(WorkerGroup)
    group._each = workers
    spec = {"source": "tokens", "seq_len": 16, "vocab": 512, "files": [{"path": str(a)}, {"path": str(b), "weight": 2.0}]}
    n = group.set_data(spec, "pack", 16)
    assert len(scans) == 2   # the driver's build
    assert n == len(corpus([{"path": str(a)}, {"path": str(b), "weight": 2.0}]))
    assert [f["max_id"] for f in sent[0]["files"]] == [int(np.concatenate(d).max()) for d in (docs_a, docs_b)]
    big = write_docs(tmp_path / "big", [np.array([1, 2, 700, 3])])
    with pytest.raises(DataError) as e:
        group.set_data({**spec, "files": [{"path": str(big)}]}, "pack", 16)
    assert "token id 700" in one_line(e) and len(sent) == 1
    with pytest.raises(DataError, match="token id 700"):   # a max_id given is checked as well
        corpus([{"path": str(a), "max_id": 700}])


# ------------------------------------------------------------------------------------- prepare-data
def stdlib_texts(folder: Path, count: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    texts = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]]
    for i, t in enumerate(texts):
        (folder / f"{i:03d}.txt").write_text(t)
    return texts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from malleus_svc.prepare_data import prepare

    d = tmp_path_factory.mktemp("tok")
    stdlib_texts(d / "docs", 20)
    prepare([str(d / "docs")], str(d / "tokenizer.json"), str(d / "c"), train_vocab=400, workers=1)
    return d / "tokenizer.json"


def test_prepare_data_round_trips_text_jsonl_and_parquet(tmp_path, tokenizer, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    texts = stdlib_texts(tmp_path / "docs", 6)
    with open(tmp_path / "more.jsonl", "w") as f:
        for t in ("first record", "", "second record"):
            f.write(json.dumps({"body": t}) + "\n")
    pq.write_table(pa.table({"body": ["a parquet row", "   "]}), tmp_path / "rows.parquet")
    assert main(["prepare-data", str(tmp_path / "docs"), "--tokenizer", str(tokenizer), "--out",
                 str(tmp_path / "out" / "c"), "--workers", "2"]) == 0
    printed = capsys.readouterr().out
    assert "6 documents" in printed
    tok = Tokenizer.from_file(str(tokenizer))
    eod = tok.token_to_id("<|endoftext|>")
    f = open_indexed(tmp_path / "out" / "c")
    assert len(f) == 6
    for k, text in enumerate(texts):
        ids = f.ids(int(f.starts[k]), int(f.lengths[k])).tolist()
        assert ids[-1] == eod and tok.decode(ids[:-1]) == text
    summary = json.loads((tmp_path / "out" / "c.json").read_text())
    assert summary["tokens"] == f.tokens and summary["max_token_id"] == max(
        int(f.ids(0, f.tokens).max()), 0) and summary["vocab_size"] == 400
    # the length histogram, printed: one line per log2 bin of the documents' lengths, bars to scale
    histogram = summary["lengths"]["histogram"]
    assert sum(c for _, _, c in histogram) == 6
    assert sorted(c for _, _, c in histogram if c) == sorted(Counter(int(n).bit_length() for n in f.lengths).values())
    bars = [line.split() for line in printed.splitlines() if line.startswith("  ")]
    assert bars == [[f"{lo}-{hi - 1}", f"{c:,}"] + (["#" * round(40 * c / max(n for *_, n in histogram))] if c else [])
                    for lo, hi, c in histogram]

    # records from a field; blank ones are skipped
    from malleus_svc.prepare_data import prepare
    s = prepare([str(tmp_path / "more.jsonl"), str(tmp_path / "rows.parquet")], str(tokenizer),
                str(tmp_path / "out" / "r"), field="body", workers=1)
    r = open_indexed(tmp_path / "out" / "r")
    decoded = sorted(tok.decode(r.ids(int(a), int(n)).tolist()[:-1]) for a, n in zip(r.starts, r.lengths))
    assert s["documents"] == 3 and decoded == ["a parquet row", "first record", "second record"]


def test_prepare_data_refuses_bad_input_in_one_line(tmp_path, tokenizer, capsys):
    from tokenizers import Tokenizer, models

    stdlib_texts(tmp_path / "docs", 2)
    (tmp_path / "r.jsonl").write_text('{"a": "x"}\n')
    (tmp_path / "notes.csv").write_text("a,b\n")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "b.txt").write_text("  \n")
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "ok.txt").write_text("fine")
    (tmp_path / "latin" / "l1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    wide = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    wide.save(str(tmp_path / "wide.json"))
    cases = [
        ([str(tmp_path / "nowhere")], "an existing file or directory"),
        ([str(tmp_path / "notes.csv")], "a file ending in one of"),
        ([str(tmp_path / "r.jsonl")], "a field of the json records"),
        ([str(tmp_path / "docs"), "--tokenizer", str(tmp_path / "nope.json")], "tokenizer.json"),
        ([str(tmp_path / "docs"), "--eod", "<nothing>"], "a token of the tokenizer's vocabulary"),
        ([str(tmp_path / "docs"), "--tokenizer", str(tmp_path / "wide.json"), "--eod", "w1", "--dtype", "uint16"],
         "holds the tokenizer's 70000 ids"),
        ([str(tmp_path / "blank")], "non-blank document"),
        ([str(tmp_path / "latin")], "l1.txt' is not valid: utf-8 text (invalid continuation byte"),
        ([str(tmp_path / "broken.jsonl")], "readable json records"),
    ]
    for args, words in cases:
        if "--tokenizer" not in args:
            args = [*args, "--tokenizer", str(tokenizer)]
        assert main(["prepare-data", *args, "--out", str(tmp_path / "o" / "x"), "--workers", "1"]) == 2, args
        err = capsys.readouterr().err   # progress bars first, if it got that far; then one line
        last = err.strip().splitlines()[-1]
        assert last.startswith("malleus: error:") and words in last and "Traceback" not in err, (args, err)
    assert not (tmp_path / "o" / "x.bin").exists() or not (tmp_path / "o" / "x.idx").exists()
    # read anyway, the bad bytes replaced
    assert main(["prepare-data", str(tmp_path / "latin"), "--tokenizer", str(tokenizer), "--encoding-errors", "replace",
                 "--out", str(tmp_path / "o" / "l"), "--workers", "1"]) == 0
    assert "2 documents" in capsys.readouterr().out


def test_a_failed_prepare_data_leaves_the_existing_corpus_as_it_was_and_no_file_behind(tmp_path, tokenizer):
    """Failures before writing (text that is not utf-8) and while writing (an id the dtype cannot hold,
    found only once documents are being written) change no byte of an existing corpus and leave no
    temporary file; a failed run that would have trained a tokenizer creates no folder and no tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from malleus_svc.prepare_data import prepare

    stdlib_texts(tmp_path / "docs", 3)
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "l1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    sparse = Tokenizer(models.WordLevel({"w0": 0, "w1": 70_000}, unk_token="w1"))   # 2 ids, one above uint16
    sparse.pre_tokenizer = pre_tokenizers.Whitespace()
    sparse.save(str(tmp_path / "sparse.json"))
    out = tmp_path / "o" / "c"
    prepare([str(tmp_path / "docs")], str(tokenizer), str(out), workers=1)

    def snapshot() -> dict:
        return {str(f.relative_to(tmp_path)): f.read_bytes() for f in sorted(tmp_path.rglob("*")) if f.is_file()}

    before = snapshot()
    assert {"o/c.bin", "o/c.idx", "o/c.json"} <= set(before)
    failing = [
        (dict(inputs=[str(tmp_path / "latin")], tokenizer=str(tokenizer)), "utf-8 text"),
        (dict(inputs=[str(tmp_path / "docs")], tokenizer=str(tmp_path / "sparse.json"), eod="w0", dtype="uint16"),
         "holds token id 70000"),
    ]
    for kwargs, words in failing:
        with pytest.raises(ConfigError) as e:
            prepare(out=str(out), workers=1, **kwargs)
        assert words in str(e.value)
        assert snapshot() == before, kwargs
    with pytest.raises(ConfigError, match="utf-8 text"):
        prepare([str(tmp_path / "latin")], str(tmp_path / "new" / "tokenizer.json"), str(tmp_path / "new" / "c"),
                train_vocab=300, workers=1)
    assert snapshot() == before and not (tmp_path / "new").exists()


def test_a_tokenizer_larger_than_the_model_is_refused_from_the_summary(tmp_path, tokenizer):
    from malleus_svc.prepare_data import prepare

    stdlib_texts(tmp_path / "docs", 2)
    prepare([str(tmp_path / "docs")], str(tokenizer), str(tmp_path / "c"), workers=1)
    with pytest.raises(DataError) as e:
        corpus([tmp_path / "c"], vocab=300)
    assert "vocabulary of 400" in one_line(e)
    assert corpus([tmp_path / "c"], vocab=400).vocab == 400
