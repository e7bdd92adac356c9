"""A job file's `train` (the learning-rate schedule of config/lr_schedule.py, weight decay), `eval`
and `logging` sections, and the evaluation's held-out batches."""
from __future__ import annotations

import math

import pytest

from malleus_svc.config import ConfigError
from malleus_svc.config.job import JobConfig
from malleus_svc.config.lr_schedule import LrSchedule
from malleus_svc.control.evaluation import Evaluation
from malleus_svc.runtime.data import DataError


BASE = {"cluster": {"nodes": 1, "gpus_per_node": 1}, "model": "tiny", "parallel": {"dp": 1, "tp": 1, "pp": 1},
        "batch": {"global": 2, "micro": 1}}


def _train(**train) -> JobConfig:
    return JobConfig.from_dict({**BASE, "train": {"steps": 40, "lr": 1e-3, **train}})


def test_each_decay_follows_its_formula_step_by_step():
    lr, lo = 1e-3, 1e-4
    lrs = {decay: [_train(warmup_steps=5, decay=decay, decay_steps=25, min_lr=lo).train.lr_at(s) for s in range(40)]
           for decay in ("constant", "linear", "cosine", "wsd")}
    for decay, got in lrs.items():
        assert got[:5] == pytest.approx([lr * n / 5 for n in range(1, 6)], rel=1e-12), decay   # warm-up from 0
        assert got[4] == lr
    assert lrs["constant"][5:] == [lr] * 35
    for s in range(5, 40):
        progress = min((s + 1 - 5) / 20, 1.0)
        assert lrs["linear"][s] == pytest.approx(lr - (lr - lo) * progress, rel=1e-12)
        assert lrs["cosine"][s] == pytest.approx(lo + (lr - lo) * 0.5 * (1 + math.cos(math.pi * progress)), rel=1e-12)
        # wsd: stable until the last 20% of the 20 steps after warm-up, then linear to min_lr
        wsd_progress = min(max((s + 1 - 21) / 4, 0.0), 1.0)
        assert lrs["wsd"][s] == pytest.approx(lr - (lr - lo) * wsd_progress, rel=1e-12)
    for decay in ("linear", "cosine", "wsd"):
        assert lrs[decay][24:] == [pytest.approx(lo, rel=1e-12)] * 16, decay    # min_lr at update 25, and held
        assert all(a >= b for a, b in zip(lrs[decay][4:], lrs[decay][5:])), decay


def test_defaults_are_a_constant_lr_and_decay_steps_are_the_jobs_steps():
    assert [_train().train.lr_at(s) for s in (0, 39)] == [1e-3, 1e-3]
    assert _train(decay="linear").train.schedule.decay_steps == 40
    assert LrSchedule().lr_at(7, 0.5) == 0.5
    job = _train()
    assert (job.train.weight_decay, job.train.decay_embeddings) == (0.1, True)
    assert job.train.compile is None and _train(compile=True).train.compile is True   # None: on CUDA only
    assert _train(compile=False).train.compile is False and _train(compile=None).train.compile is None


@pytest.mark.parametrize("train,field,hint", [
    ({"decay": "step"}, "train.decay", "constant, linear, cosine, wsd"),
    ({"decay": "cosine", "warmup_steps": 40}, "train.decay_steps", "more steps than warmup_steps (40)"),
    ({"decay": "linear", "decay_steps": 3, "warmup_steps": 3}, "train.decay_steps", "more steps than warmup_steps"),
    ({"min_lr": 1e-2}, "train.min_lr", "at most lr"),
    ({"decay_fraction": 0}, "train.decay_fraction", "> 0"),
    ({"decay_fraction": 1.5}, "train.decay_fraction", "<= 1"),
    ({"warmup_steps": -1}, "train.warmup_steps", ">= 0"),
    ({"decay_embeddings": "no"}, "train.decay_embeddings", "true or false"),
    ({"compile": "yes"}, "train.compile", "true or false"),
])
def test_bad_schedules_name_the_field_and_what_is_accepted(train, field, hint):
    with pytest.raises(ConfigError) as e:
        _train(**train)
    assert e.value.field == field and hint in str(e.value) and "\n" not in str(e.value)


def test_the_measuring_warm_up_is_named_calibrate_and_the_old_name_says_so():
    assert JobConfig.from_dict({**BASE, "control": {"calibrate": 5}}).control.calibrate == 5
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict({**BASE, "control": {"warmup": 5}})
    assert e.value.field == "control.warmup" and "control.calibrate" in str(e.value) and "train.warmup_steps" in str(e.value)


@pytest.mark.parametrize("section,value,field,hint", [
    ("eval", {"every": 10}, "eval.holdout", "when eval.every is set"),
    ("eval", {"every": 10, "holdout": 0.6}, "eval.holdout", "<= 0.5"),
    ("eval", {"every": -1, "holdout": 0.1}, "eval.every", ">= 0"),
    ("eval", {"every": 5, "holdout": 0.1, "batches": 0}, "eval.batches", ">= 1"),
    ("eval", {"each": 5}, "eval.each", "unknown field"),
    ("logging", {"tensorboard": 3}, "logging.tensorboard", "a directory path"),
    ("logging", {"tensorboard": " "}, "logging.tensorboard", "a directory path"),
])
def test_bad_eval_and_logging_sections_name_the_field(section, value, field, hint):
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict({**BASE, section: value})
    assert e.value.field == field and hint in str(e.value) and "\n" not in str(e.value)


def test_the_evaluation_sets_its_batches_aside_and_says_when_the_holdout_is_too_small():
    job = JobConfig.from_dict({**BASE, "eval": {"every": 5, "batches": 2, "holdout": 0.1}})
    evaluation = Evaluation(job.eval, seed=0)
    sampler = evaluation.sampler(200, 8)
    held = [i for b in evaluation.batches for i in b]
    assert [len(b) for b in evaluation.batches] == [8, 8] and sampler.num_samples == 180
    assert not set(held) & {i for _ in range(23) for i in sampler.next_global_batch()}
    assert [evaluation.due(s) for s in range(10)] == [False] * 4 + [True] + [False] * 4 + [True]
    with pytest.raises(DataError, match="eval needs 2 global batches of 8 held-out samples, eval.holdout 0.1 "
                                        "of the 100 samples holds out 10"):
        Evaluation(job.eval, seed=0).sampler(100, 8)


def test_held_out_files_are_the_evaluations_samples_and_never_trained_on(tmp_path):
    """`eval.holdout` as a list of files: the corpus gets them after its training files; every
    evaluation sample comes from them, in a seeded order across them, and the training sampler
    never yields one."""
    import numpy as np

    from malleus_svc.runtime.datasets import build_dataset
    from malleus_svc.runtime.token_files import IndexedWriter

    def corpus(name: str, docs: int, seed: int) -> str:
        rng = np.random.default_rng(seed)
        lengths = rng.integers(20, 120, size=docs)
        w = IndexedWriter(tmp_path / name, "uint16")
        w.add(rng.integers(0, 256, size=int(lengths.sum())), lengths)
        w.close()
        return str(tmp_path / name)

    train, held = [corpus("train", 60, 1)], [corpus("val-a", 8, 2), corpus("val-b", 8, 3)]
    tokens = {"source": "tokens", "seq_len": 64, "files": train}
    job = JobConfig.from_dict({**BASE, "data": tokens, "eval": {"every": 5, "batches": 3, "holdout": held}})
    spec = job.dataset_spec()
    assert [f["path"] for f in spec["files"]] == train + held
    dataset = build_dataset(spec)
    evaluation = Evaluation(job.eval, seed=0, dataset_spec=spec)
    sampler = evaluation.sampler(len(dataset), 2)
    files_of = lambda ids: {dataset.document_of(int(i))[0] for i in ids}    # noqa: E731
    evaluated = [i for b in evaluation.batches for i in b]
    assert len(evaluated) == 6 and files_of(evaluated) == {1, 2}
    assert files_of(range(len(dataset))) == {0, 1, 2}
    trained = {i for _ in range(sampler.num_samples) for i in sampler.next_global_batch()}   # two epochs
    assert files_of(trained) == {0} and len(trained) == sampler.num_samples == len(build_dataset(
        {**spec, "files": spec["files"][:1]}))
    for bad, hint in (({"data": {"source": "synthetic"}}, "held-out files are for data.source tokens"),
                      ({"data": tokens, "eval": {"every": 5, "holdout": train}}, "that data.files does not name")):
        with pytest.raises(ConfigError, match=hint):
            JobConfig.from_dict({**BASE, "eval": {"every": 5, "holdout": held}, **bad})
