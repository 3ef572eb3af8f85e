"""`kvtool inspect store` and `watermarks`: metrics parsing and record rows, without a master."""

from connector.core.keys import Namespace, watermark_key
from connector.core.watermarks import SaveState, WatermarkRecord
from kvtool.inspect.store import DEFAULT_EVICTION_HIGH_WATERMARK, store_summary
from kvtool.prometheus import samples as parse_prometheus
from kvtool.inspect.watermarks import latest_record_keys, load_records, watermark_rows

PAGE = """# HELP master_key_count Total number of keys
# TYPE master_key_count gauge
master_key_count 7
master_allocated_bytes 950
master_total_capacity_bytes 1000
master_evicted_key_count 3
master_put_start_alloc_failures_total 2
master_put_start_failures_total 2
some_labelled{a="b"} 1
"""


def test_metrics_become_the_store_summary_with_the_default_high_watermark():
    summary = store_summary(parse_prometheus(PAGE), None)
    assert (summary["key_count"], summary["used_bytes"], summary["capacity_bytes"]) == (7, 950, 1000)
    assert (summary["evicted_keys"], summary["put_no_space_failures"], summary["put_failures"]) == (3, 2, 2)
    assert summary["used_ratio"] == 0.95 and summary["above_high_watermark"]
    assert summary["eviction_high_watermark"] == DEFAULT_EVICTION_HIGH_WATERMARK
    assert "default" in summary["eviction_high_watermark_source"]
    assert summary["evictions"] is None  # not on this page


def test_a_given_high_watermark_is_used_and_an_empty_store_has_no_ratio():
    assert not store_summary(parse_prometheus(PAGE), 0.99)["above_high_watermark"]
    empty = store_summary(parse_prometheus("master_total_capacity_bytes 0\nmaster_allocated_bytes 0\n"), None)
    assert empty["used_ratio"] is None and not empty["above_high_watermark"]


def test_watermark_rows_show_the_record_or_why_it_is_unreadable():
    ns = Namespace("m", "float32", "cpu", 32, 2, 2, 64).key_component()
    record = WatermarkRecord("req-1", None, 85, 64, 85, True, SaveState.DURABLE, None, 1.0)
    keys = [watermark_key(ns, "req-1", 1), watermark_key(ns, "req-2", 0), watermark_key(ns, "req-3", 0)]
    values = {keys[0]: record.encode(), keys[1]: None, keys[2]: b"not json"}
    rows = watermark_rows(load_records(latest_record_keys(keys), lambda ks: [values[k] for k in ks]))
    by_state = {row["state"]: row for row in rows}
    assert by_state["durable"]["durable_offset"] == 64 and by_state["durable"]["tail_boundary"] == 85
    assert sorted(row["state"] for row in rows) == ["durable", "unreadable", "unreadable"]


def test_one_prometheus_parser_sums_label_sets_and_keeps_labelled_names():
    from kvtool import prometheus

    page = 'x_total{engine="0"} 2\nx_total{engine="1"} 3\n# HELP y\ny 1.5\nbad line\n'
    assert prometheus.total(page, "x_total") == 5.0 and prometheus.total(page, "x") is None
    assert prometheus.samples(page) == {'x_total{engine="0"}': 2.0, 'x_total{engine="1"}': 3.0, "y": 1.5}
