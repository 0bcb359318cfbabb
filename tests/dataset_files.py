"""The support package's datasets (support/data.py: MNIST from the real t10k
digits as IDX files, Tiny Shakespeare as a corpus and as nanoGPT's token
files, a tiny CIFAR-10), for the tests: where the shared data one needs is
absent, the test is skipped saying why, or failed under CI=true, where the
data must be there."""

from __future__ import annotations

import functools

import pytest

from helpers import IN_CI
from support import data
from support.data import MNIST_T10K, TINYSHAKESPEARE, build_cifar10_root  # noqa: F401


def _required(function):
    """``function`` (of support.data), with shared data that is absent skipping the test (CI: failing it)."""

    @functools.wraps(function)
    def required(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except data.Absent as exc:
            if IN_CI:
                pytest.fail(f"{exc}; CI must run this test")
            pytest.skip(str(exc))

    return required


require_mnist_t10k = _required(data.require_mnist_t10k)
require_tinyshakespeare = _required(data.require_tinyshakespeare)
build_mnist_root = _required(data.build_mnist_root)
build_shakespeare_root = _required(data.build_shakespeare_root)
build_token_files = _required(data.build_token_files)
