"""passes/_pages: huge pages for fresh decode outputs are limited only on hosts whose virtio
balloon reports free pages (there, gigabytes of fresh huge pages were several times slower)."""
import pytest

from passes import _pages
from passes.runtime_arena import Arena


def _balloon(root, features):
    device = root / "bus/virtio/drivers/virtio_balloon/virtio3"
    device.mkdir(parents=True)
    (device / "features").write_text(features + "\n")
    return str(root)


@pytest.mark.parametrize("features,reporting", [("0110010" + "0" * 57, True), ("0110000" + "0" * 57, False),
                                                ("011", False), ("", False)])
def test_free_page_reporting_reads_the_balloon_feature_bit(tmp_path, features, reporting):
    assert _pages.free_page_reporting(_balloon(tmp_path, features)) is reporting


def test_no_balloon_no_reporting(tmp_path):
    assert _pages.free_page_reporting(str(tmp_path)) is False


def test_the_budget_follows_the_host(monkeypatch):
    monkeypatch.setattr(_pages, "free_page_reporting", lambda: True)
    assert _pages.huge_page_budget() == _pages.REPORTING_HOST_BUDGET
    assert Arena()._huge_left == _pages.REPORTING_HOST_BUDGET
    monkeypatch.setattr(_pages, "free_page_reporting", lambda: False)
    assert _pages.huge_page_budget() == float("inf")
