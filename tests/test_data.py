"""Deterministic data for the runtime: sampler, plan slicing, bundled sources, collation."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from malleus_svc.plan import Pipeline, Plan, Stage
from malleus_svc.runtime.batch import IGNORE_INDEX
from malleus_svc.runtime.data import DataError, GlobalSampler, holdout_split, split_for_plan
from malleus_svc.runtime.datasets import (PythonSourceCorpus, SyntheticVarLen, TokenDataset, build_dataset,
                                          collate, length_stats)


def make_plan(micro_batch_size: int, micro_batches: list[int], num_layers: int = 4) -> Plan:
    """One single-device stage per pipeline; pipeline i runs micro_batches[i] micro-batches."""
    pipes = tuple(Pipeline(stages=(Stage((i,), (0, num_layers)),), micro_batches=m)
                  for i, m in enumerate(micro_batches))
    return Plan(num_devices=len(pipes), num_layers=num_layers, micro_batch_size=micro_batch_size, pipelines=pipes)


# ------------------------------------------------------------------------------------ sampler
def test_exactly_once_over_an_epoch_with_changing_plans():
    n = 96
    a = make_plan(2, [3, 1])        # 8 = 2 x 4
    b = make_plan(1, [2, 3, 3])     # 8 = 1 x 8
    c = make_plan(4, [2])           # 8 = 4 x 2
    d = make_plan(2, [4, 1, 1])     # 12: a different global batch
    schedule = [a, b, c, d, a, d, b, c, d, d]
    assert sum(p.global_batch for p in schedule) == n
    sampler = GlobalSampler(n, global_batch=8, seed=3)
    seen = []
    for plan in schedule:
        planned = sampler.peek(size=plan.global_batch)
        batch = sampler.next_global_batch(plan.global_batch)
        assert batch == planned and len(batch) == plan.global_batch
        parts = split_for_plan(batch, plan)
        assert len(parts) == len(plan.pipelines)
        for pipe, micro, (lo, hi) in zip(plan.pipelines, parts, plan.sample_slices()):
            assert len(micro) == pipe.micro_batches
            assert all(len(mb) == plan.micro_batch_size for mb in micro)
            assert [i for mb in micro for i in mb] == batch[lo:hi]       # contiguous slice
        assert [i for pipe in parts for mb in pipe for i in mb] == batch  # union, in order
        seen.extend(batch)
    assert sorted(seen) == list(range(n))
    assert sampler.position == n and sampler.epoch == 1
    assert sorted(sampler.next_global_batch(8) + sampler.next_global_batch(88)) == list(range(n))


def test_a_batch_at_the_end_of_an_epoch_continues_into_the_next_and_drops_nothing():
    s = GlobalSampler(10, global_batch=4, seed=0)
    b0, b1 = s.next_global_batch(), s.next_global_batch()
    assert s.position == 8 and s.epoch == 0
    b2 = s.next_global_batch()
    assert s.position == 12 and s.epoch == 1
    assert b0 + b1 == s.permutation(0)[:8].tolist()
    assert b2 == s.permutation(0)[8:].tolist() + s.permutation(1)[:2].tolist()   # the tail, then epoch 1
    assert sorted(b0 + b1 + b2[:2]) == list(range(10))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 60), sizes=st.lists(st.integers(1, 60), min_size=1, max_size=25), seed=st.integers(0, 2**16))
def test_every_epoch_uses_each_sample_exactly_once_whatever_the_batch_sizes(n, sizes, seed):
    s = GlobalSampler(n, global_batch=1, seed=seed)
    stream: list[int] = []
    for size in sizes:
        size = min(size, n)
        batch = s.next_global_batch(size)
        assert len(batch) == size and all(0 <= i < n for i in batch)
        stream += batch
    assert s.position == len(stream) and s.epoch == len(stream) // n
    for e in range(0, len(stream), n):       # each epoch a permutation (the last one may be partial)
        epoch = stream[e:e + n]
        assert len(set(epoch)) == len(epoch)
        if len(epoch) == n:
            assert sorted(epoch) == list(range(n))


def test_same_seed_same_batches_and_different_seed_differs():
    runs = [[GlobalSampler(50, 7, seed=s).next_global_batch() for _ in range(1)] for s in (5, 5, 6)]
    a, b = GlobalSampler(50, 7, seed=5), GlobalSampler(50, 7, seed=5)
    assert [a.next_global_batch() for _ in range(20)] == [b.next_global_batch() for _ in range(20)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_state_dict_round_trip_resumes_at_the_same_batch():
    s = GlobalSampler(37, 5, seed=11)
    for _ in range(9):                                              # crosses an epoch boundary
        s.next_global_batch()
    s.next_global_batch(size=6)
    state = pickle.loads(pickle.dumps(s.state_dict()))
    expected = [s.next_global_batch() for _ in range(12)]
    r = GlobalSampler(37, 1, seed=11)
    r.load_state_dict(state)
    assert r.global_batch == 6 and r.position == state["position"]
    assert [r.next_global_batch() for _ in range(12)] == expected
    with pytest.raises(DataError, match="seed 11.*seed 12"):
        GlobalSampler(37, 5, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="37 samples"):
        GlobalSampler(38, 5, seed=11).load_state_dict(state)


def test_peek_does_not_consume_and_matches_future_batches():
    s = GlobalSampler(23, 4, seed=2)
    s.next_global_batch()
    ahead = [s.peek(k) for k in range(8)]
    pos = s.position
    assert s.position == pos
    assert [s.next_global_batch() for _ in range(8)] == ahead


def test_epochs_give_different_permutations():
    s = GlobalSampler(64, 64, seed=0)
    e0, e1, e2 = (s.next_global_batch() for _ in range(3))
    for e in (e0, e1, e2):
        assert sorted(e) == list(range(64))
    assert e0 != e1 and e1 != e2 and e0 != e2
    assert s.epoch == 3


def test_held_out_samples_are_seeded_disjoint_and_never_sampled():
    train, held = holdout_split(200, 0.05, seed=3)
    assert len(held) == 10 and len(train) == 190 and not set(train) & set(held)
    assert sorted([*train, *held]) == list(range(200))
    again, other = holdout_split(200, 0.05, seed=3), holdout_split(200, 0.05, seed=4)
    assert np.array_equal(again[1], held) and not np.array_equal(other[1], held)
    assert len(holdout_split(200, 0.001, seed=0)[1]) == 1 and len(holdout_split(200, 0.0, seed=0)[1]) == 0
    sampler = GlobalSampler(len(train), 19, seed=3, ids=train)
    for _ in range(3):     # three epochs: every training sample once per epoch, no held-out one ever
        epoch = [i for _ in range(10) for i in sampler.next_global_batch()]
        assert sorted(epoch) == sorted(train.tolist())
    # without a holdout the stream is the one a sampler over range(n) gives
    plain, over_ids = GlobalSampler(50, 7, seed=1), GlobalSampler(50, 7, seed=1, ids=holdout_split(50, 0.0, 1)[0])
    assert [plain.next_global_batch() for _ in range(9)] == [over_ids.next_global_batch() for _ in range(9)]


def test_sampler_and_split_errors_are_specific():
    with pytest.raises(DataError, match=r"global batch size 11 is larger than the dataset \(10 samples\)"):
        GlobalSampler(10, 11)
    with pytest.raises(DataError, match="num_samples must be >= 1"):
        GlobalSampler(0, 1)
    s = GlobalSampler(10, 2)
    with pytest.raises(DataError, match="larger than the dataset"):
        s.next_global_batch(size=12)
    with pytest.raises(DataError, match="global batch size must be an int"):
        s.next_global_batch(size=2.5)
    plan = make_plan(2, [1, 2])
    with pytest.raises(DataError, match="has 5 samples but plan .* needs exactly 6"):
        split_for_plan(list(range(5)), plan)


# ------------------------------------------------------------------------------------ collate
@pytest.fixture(scope="module")
def synth() -> SyntheticVarLen:
    return SyntheticVarLen(num_samples=200, seq_len=64, vocab=97, seed=4)


def test_collate_pack_boundaries_and_shifted_targets(synth):
    ids = [3, 17, 0, 150, 42]
    seqs = [synth[i] for i in ids]
    mb = collate(synth, ids)
    assert mb.sample_ids == tuple(ids)
    assert mb.tokens.dtype == torch.int64 and mb.cu_seqlens.dtype == torch.int32
    assert torch.diff(mb.cu_seqlens).tolist() == [len(s) - 1 for s in seqs]
    assert mb.num_tokens == mb.num_loss_tokens == sum(len(s) - 1 for s in seqs)
    for s, lo, hi in zip(seqs, mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist()):
        assert torch.equal(mb.tokens[lo:hi], s[:-1])
        assert torch.equal(mb.targets[lo:hi], s[1:])
        # within a segment the targets are the inputs shifted by one ...
        assert torch.equal(mb.targets[lo:hi - 1], mb.tokens[lo + 1:hi])
        # ... and the last target is the sequence's own last token, not the next segment's first
        assert int(mb.targets[hi - 1]) == int(s[-1])
    assert (mb.positions()[mb.cu_seqlens[:-1].long()] == 0).all()


def test_collate_pad_ignores_pad_targets(synth):
    ids = [5, 6, 7]
    seqs = [synth[i] for i in ids]
    mb = collate(synth, ids, mode="pad")
    L = synth.seq_len
    assert mb.cu_seqlens.tolist() == [0, L, 2 * L, 3 * L]
    assert mb.num_loss_tokens == sum(len(s) - 1 for s in seqs)
    for k, s in enumerate(seqs):
        n = len(s) - 1
        row_x, row_y = mb.tokens[k * L:(k + 1) * L], mb.targets[k * L:(k + 1) * L]
        assert torch.equal(row_x[:n], s[:-1]) and torch.equal(row_y[:n], s[1:])
        assert (row_x[n:] == 0).all() and (row_y[n:] == IGNORE_INDEX).all()


def test_collate_errors(synth):
    with pytest.raises(DataError, match=r"collate mode must be one of \['pack', 'pad'\], got 'zip'"):
        collate(synth, [1], mode="zip")
    with pytest.raises(DataError, match="at least one sample id"):
        collate(synth, [])
    with pytest.raises(DataError, match=r"more than seq_len \+ 1 = 5"):
        collate(synth, [0, 1, 2], mode="pad", seq_len=4)

    class Bare:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            return torch.tensor([7])

    with pytest.raises(DataError, match="needs seq_len"):
        collate(Bare(), [0], mode="pad")
    with pytest.raises(DataError, match="sample 0 has 1 token"):
        collate(Bare(), [0])


# ------------------------------------------------------------------------------------ synthetic
def test_synthetic_lengths_long_tailed_and_in_bounds():
    d = SyntheticVarLen(num_samples=4000, seq_len=512, vocab=128, seed=0, sigma=1.0)
    lens = d.lengths
    assert lens.min() >= d.min_len == 8 and lens.max() <= 513
    st_ = length_stats(lens)
    assert st_["p99"] / st_["p50"] > 3
    assert st_["count"] == 4000 and sum(c for _, _, c in st_["histogram"]) == 4000
    for i in (0, 1, 999, 3999):
        x = d[i]
        assert x.dtype == torch.int64 and len(x) == lens[i] == d.length(i)
        assert int(x.min()) >= 0 and int(x.max()) < 128
    assert isinstance(d, TokenDataset)


def test_synthetic_is_a_function_of_seed_and_index():
    a = SyntheticVarLen(50, 128, 300, seed=9)
    b = SyntheticVarLen(5000, 128, 300, seed=9)                   # more samples: same prefix
    c = SyntheticVarLen(50, 128, 300, seed=10)
    for i in range(50):
        assert torch.equal(a[i], b[i])
    assert any(not torch.equal(a[i], c[i]) for i in range(50))
    assert torch.equal(pickle.loads(pickle.dumps(a))[7], a[7])


def test_synthetic_tokens_follow_a_sparse_learnable_bigram_table():
    d = SyntheticVarLen(300, 256, 64, seed=1)
    successors: dict[int, set[int]] = {}
    for i in range(len(d)):
        x = d[i].tolist()
        for p, q in zip(x, x[1:]):
            successors.setdefault(p, set()).add(q)
    assert len(successors) > 32
    assert max(len(v) for v in successors.values()) <= 4            # vs 64 for uniform noise
    assert d.entropy_floor < np.log(64) / 2


# ------------------------------------------------------------------------------------ corpus
def test_python_source_corpus_finds_files_and_decodes_to_source():
    c = PythonSourceCorpus(seq_len=255, max_files=60)
    assert len(c.files) == 60 and c.vocab == 256
    rel = [p.relative_to(c.root).as_posix() for p in c.files]
    assert rel == sorted(rel)
    assert len(c) == c.total_bytes // 256 and c.avg_length == 256
    chunks = [c.text(i) for i in range(len(c))]
    assert all(len(c[i]) == 256 for i in (0, len(c) - 1))
    joined = "".join(chunks)
    assert "import " in joined and "def " in joined and "class " in joined
    # a document equals its file, byte for byte
    docs = PythonSourceCorpus(seq_len=1 << 20, mode="documents", max_files=60)
    k = next(i for i in range(len(docs)) if docs.file_of(i).name != "__init__.py")
    assert bytes(docs[k].to(torch.uint8).tolist()) == docs.file_of(k).read_bytes()
    compile(docs.file_of(k).read_bytes(), str(docs.file_of(k)), "exec")
    compile(docs.text(k), "<decoded>", "exec")                        # decodes back to valid Python


def test_python_source_corpus_is_deterministic_and_picklable():
    a = PythonSourceCorpus(seq_len=128, max_files=40)
    b = PythonSourceCorpus(seq_len=128, max_files=40)
    assert a.files == b.files and len(a) == len(b)
    for i in (0, 10, len(a) - 1):
        assert torch.equal(a[i], b[i])
    blob = pickle.dumps(a)
    assert len(blob) < a.total_bytes                                  # the buffer is not shipped
    assert torch.equal(pickle.loads(blob)[10], a[10])


def test_python_source_corpus_pack_and_documents_layout(tmp_path):
    (tmp_path / "b.py").write_bytes(b"y = 2\n")                      # 6 bytes
    (tmp_path / "a.py").write_bytes(b"x = 1234567\n")                # 12 bytes
    (tmp_path / "empty.py").write_bytes(b"")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "zz.py").write_bytes(b"nope\n")
    (tmp_path / "notes.txt").write_bytes(b"not python\n")
    pack = PythonSourceCorpus(seq_len=4, root=tmp_path)              # chunks of 5 bytes
    assert [p.name for p in pack.files] == ["a.py", "b.py", "empty.py"]
    stream = b"x = 1234567\n" + b"\n" + b"y = 2\n" + b"\n" + b""
    assert pack.total_bytes == len(stream) == 20 and len(pack) == 4
    assert [bytes(pack[i].tolist()) for i in range(4)] == [stream[i * 5:(i + 1) * 5] for i in range(4)]
    docs = PythonSourceCorpus(seq_len=4, mode="documents", root=tmp_path)
    assert [bytes(docs[i].tolist()) for i in range(len(docs))] == [b"x = 1", b"23456", b"7\n", b"y = 2", ]
    assert docs.lengths.tolist() == [5, 5, 2, 5]                     # b.py's 1-byte tail "\n" is dropped
    assert docs.describe()["avg_length"] == 17 / 4


def test_full_stdlib_corpus_reports_size():
    c = PythonSourceCorpus(seq_len=1024, mode="documents")
    info = c.describe()
    assert info["files"] > 500 and info["len"] == len(c) > 1000
    assert any(p.name == "os.py" and p.parent == c.root for p in c.files)
    assert not any("site-packages" in p.parts for p in c.files)
    assert 2 <= info["lengths"]["min"] and info["lengths"]["max"] == 1025
    assert 0 < info["avg_length"] <= 1025


# ------------------------------------------------------------------------------------ stats and config
def test_length_stats_small_example():
    s = length_stats([1, 2, 3, 4, 100])
    assert s["count"] == 5 and s["total"] == 110 and s["max"] == 100 and s["min"] == 1 and s["p50"] == 3
    assert s["histogram"] == [[1, 2, 1], [2, 4, 2], [4, 8, 1], [8, 16, 0], [16, 32, 0], [32, 64, 0], [64, 128, 1]]
    with pytest.raises(DataError, match="non-empty"):
        length_stats([])


def test_build_dataset_and_its_errors():
    d = build_dataset({"source": "synthetic", "seq_len": 32, "num_samples": 10, "vocab": 50, "seed": 2})
    assert isinstance(d, SyntheticVarLen) and len(d) == 10 and torch.equal(d[3], SyntheticVarLen(10, 32, 50, 2)[3])
    c = build_dataset({"source": "python-stdlib", "seq_len": 64, "mode": "documents", "max_files": 5,
                       "num_samples": 7, "vocab": 256, "seed": 0})
    assert isinstance(c, PythonSourceCorpus) and len(c) == 7 and c.mode == "documents"
    bad = [
        ({"source": "wiki", "seq_len": 8}, r"'source' must be one of \['synthetic', 'python-stdlib', 'tokens'\], got 'wiki'"),
        ({"source": "synthetic", "seq_len": 1, "num_samples": 5, "vocab": 9}, "seq_len must be >= 2, got 1"),
        ({"source": "synthetic", "seq_len": 8, "vocab": 9}, r"missing the required field\(s\) \['num_samples'\]"),
        ({"source": "synthetic", "seq_len": 8, "num_samples": 5, "vocab": 9, "sequence_len": 3},
         r"\['sequence_len'\] are not accepted for source 'synthetic'; accepted: \["),
        ({"source": "synthetic", "seq_len": "8", "num_samples": 5, "vocab": 9}, "seq_len must be an int"),
        ({"source": "python-stdlib", "seq_len": 8, "mode": "lines"},
         r"'mode' must be one of \['pack', 'documents'\] for python-stdlib, got 'lines'"),
        ({"source": "python-stdlib", "seq_len": 8, "vocab": 100}, "needs a vocab of at least 256"),
        ({"source": "python-stdlib", "seq_len": 8, "max_files": 1, "num_samples": 10**9}, "exceeds the"),
        ({"source": "synthetic", "seq_len": 8, "num_samples": 5, "vocab": 9, "min_len": 20}, "min_len 20 exceeds"),
    ]
    for spec, pattern in bad:
        with pytest.raises(DataError, match=pattern):
            build_dataset(spec)
    with pytest.raises(DataError, match="must be a dict"):
        build_dataset(["synthetic"])
