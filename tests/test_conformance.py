"""ONNX node-test conformance: every case in tests/conformance/manifest.txt must keep passing.

The slow test runs every case of every op the engine claims and fails if a manifest case
regressed; it prints the per-op counts. To add newly passing cases to the manifest:
``python -m tests.conformance.runner --all --write-manifest``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ortrain._ortrain")

from conformance import runner  # noqa: E402  (tests/ is on sys.path under pytest)

MANIFEST = runner.read_manifest()


def test_manifest_is_not_empty_and_unique():
    assert len(MANIFEST) > 100
    assert len(MANIFEST) == len(set(MANIFEST)), "duplicate cases in manifest.txt"


@pytest.mark.parametrize("name", MANIFEST)
def test_node_case(name: str):
    status, detail = runner.check(name)
    assert status == "pass", f"{name}: {status}: {detail}"


@pytest.mark.slow
def test_all_claimed_ops(capsys):
    results = runner.run_all()
    with capsys.disabled():
        print("\n" + runner.summary(results))
    listed = set(MANIFEST)
    regressed = [f"{n}: {d}" for rows in results.values() for n, s, d in rows if s != "pass" and n in listed]
    assert not regressed, "manifest cases now failing:\n" + "\n".join(regressed)
    new = [n for rows in results.values() for n, s, _ in rows if s == "pass" and n not in listed]
    if new:
        print(f"{len(new)} passing cases not in the manifest (regenerate it): {', '.join(new[:20])}")
