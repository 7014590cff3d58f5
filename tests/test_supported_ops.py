"""doc/SUPPORTED-OPS.md must be what tests/tools/supported_ops.py generates now."""

from __future__ import annotations

import pytest

pytest.importorskip("ortrain._ortrain")

from tools import supported_ops  # noqa: E402  (tests/ is on sys.path under pytest)


def test_supported_ops_doc_is_up_to_date():
    committed = supported_ops.DOC.read_text() if supported_ops.DOC.exists() else ""
    assert committed == supported_ops.generate(), "doc/SUPPORTED-OPS.md is out of date: run python tests/tools/supported_ops.py"


def test_every_manifest_op_is_in_the_doc():
    text = supported_ops.DOC.read_text()
    for op in supported_ops.conformance_counts():
        assert f"| {op} |" in text, op
