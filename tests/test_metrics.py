"""pdserve.metrics: Prometheus text exposition format 0.0.4, without prometheus_client."""

from __future__ import annotations

import math
import re
import threading

import pytest

from pdserve.metrics import CONTENT_TYPE, Counter, Histogram, Registry, format_value

# One sample line: name, optional {labels}, value (the format's grammar, minus timestamps).
_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? \S+$')


def _check_grammar(text: str) -> None:
    assert text.endswith("\n")
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or _SAMPLE.match(line), line


def test_counter_with_and_without_labels():
    reg = Registry()
    requests = reg.counter("pdserve_requests_total", "Requests by status.", ["status"])
    plain = reg.counter("pdserve_things_total", "Things.")
    requests.labels(status="200").inc()
    requests.labels("200").inc(2)
    requests.labels(status=429).inc()
    plain.inc(0.5)
    assert requests.labels("200").value == 3.0
    assert reg.render() == (
        "# HELP pdserve_requests_total Requests by status.\n"
        "# TYPE pdserve_requests_total counter\n"
        'pdserve_requests_total{status="200"} 3.0\n'
        'pdserve_requests_total{status="429"} 1.0\n'
        "# HELP pdserve_things_total Things.\n"
        "# TYPE pdserve_things_total counter\n"
        "pdserve_things_total 0.5\n"
    )


def test_unlabelled_metric_shows_zero_and_labelled_one_shows_no_sample():
    reg = Registry()
    reg.counter("a_total", "A.")
    reg.gauge("b", "B.", ["node"])
    assert (
        reg.render()
        == "# HELP a_total A.\n# TYPE a_total counter\na_total 0.0\n# HELP b B.\n# TYPE b gauge\n"
    )


def test_counter_rejects_decrease():
    with pytest.raises(ValueError, match="only go up"):
        Counter("x_total", "X.").inc(-1)


def test_gauge_set_inc_dec_and_function():
    reg = Registry()
    g = reg.gauge("pdserve_running", "Running.")
    g.set(5)
    g.inc()
    g.dec(2)
    assert g.value == 4.0
    per_node = reg.gauge("pdserve_node_up", "Up.", ["role", "node"])
    state = {"up": 0}
    per_node.labels("decode", "http://d:1").set_function(lambda: state["up"])
    state["up"] = 1
    text = reg.render()
    assert "pdserve_running 4.0\n" in text
    assert 'pdserve_node_up{role="decode",node="http://d:1"} 1.0\n' in text


def test_histogram_buckets_are_cumulative_with_sum_and_count():
    reg = Registry()
    h = reg.histogram("lat_seconds", "Latency.", buckets=[0.1, 1, 10])
    for v in (0.05, 0.1, 0.5, 2.0, 100.0):
        h.observe(v)
    assert h.count == 5
    assert h.sum == pytest.approx(102.65)
    lines = reg.render().splitlines()
    assert lines[1] == "# TYPE lat_seconds histogram"
    assert lines[2:] == [
        'lat_seconds_bucket{le="0.1"} 2',
        'lat_seconds_bucket{le="1.0"} 3',
        'lat_seconds_bucket{le="10.0"} 4',
        'lat_seconds_bucket{le="+Inf"} 5',
        "lat_seconds_sum 102.65",
        "lat_seconds_count 5",
    ]


def test_histogram_with_labels_puts_le_last():
    reg = Registry()
    h = reg.histogram("ttft_seconds", "TTFT.", ["model"], buckets=[1.0])
    h.labels(model="m").observe(0.5)
    text = reg.render()
    assert 'ttft_seconds_bucket{model="m",le="1.0"} 1\n' in text
    assert 'ttft_seconds_bucket{model="m",le="+Inf"} 1\n' in text
    assert 'ttft_seconds_count{model="m"} 1\n' in text
    _check_grammar(text)


def test_escaping_of_label_values_and_help():
    reg = Registry()
    c = reg.counter("esc_total", 'Help with \\ and\nnewline "quotes".', ["v"])
    c.labels(v='a"b\\c\nd').inc()
    text = reg.render()
    assert '# HELP esc_total Help with \\\\ and\\nnewline "quotes".\n' in text
    assert 'esc_total{v="a\\"b\\\\c\\nd"} 1.0\n' in text
    _check_grammar(text)


def test_special_values():
    assert format_value(math.inf) == "+Inf"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(math.nan) == "NaN"
    assert format_value(3.0) == "3.0"
    assert format_value(3) == "3"
    assert format_value(1e20) == "1e+20"


@pytest.mark.parametrize(
    "make",
    [
        lambda r: r.counter("bad-name", "x"),
        lambda r: r.counter("ok_total", "x", ["bad-label"]),
        lambda r: r.counter("ok_total", "x", ["__reserved"]),
        lambda r: r.counter("ok_total", "x", ["a", "a"]),
        lambda r: r.histogram("h", "x", ["le"]),
        lambda r: r.histogram("h", "x", buckets=[1.0, 0.5]),
    ],
)
def test_invalid_definitions(make):
    with pytest.raises(ValueError):
        make(Registry())


def test_duplicate_registration_and_label_misuse():
    reg = Registry()
    c = reg.counter("dup_total", "x", ["a"])
    with pytest.raises(ValueError, match="already registered"):
        reg.counter("dup_total", "x")
    with pytest.raises(ValueError):
        c.inc()  # labelled: needs .labels()
    with pytest.raises(ValueError):
        c.labels("1", "2")
    with pytest.raises(ValueError):
        c.labels(b="1")
    with pytest.raises(ValueError):
        c.labels("1", a="1")
    c.labels("x").inc()
    c.remove("x")
    assert "dup_total{" not in reg.render()


def test_threads_do_not_lose_increments():
    h = Histogram("t_seconds", "x", buckets=[1.0])
    c = Counter("t_total", "x")

    def work():
        for _ in range(2000):
            c.inc()
            h.observe(0.5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.value == 8000
    assert h.count == 8000


def test_content_type():
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_snapshots_of_several_processes_merge():
    """What a proxy worker's /metrics shows for all workers: counters and histograms add up, a
    gauge adds up or takes the largest."""
    from pdserve.metrics import merge_snapshots, parse_text

    regs = [Registry(), Registry()]
    for n, reg in enumerate(regs, start=1):
        reg.counter("req_total", "R.", ["status"]).labels("200").inc(n)
        reg.gauge("running", "Running.").set(n)
        reg.gauge("up", "Up.", ["node"], merge="max").labels("a").set(n - 1)
        reg.histogram("lat", "L.", buckets=(0.1, 1.0)).observe(0.05 * n)
    regs[1].get("req_total").labels("500").inc()
    text = merge_snapshots([r.snapshot() for r in regs])
    assert parse_text(text) == {
        'req_total{status="200"}': 3.0,
        'req_total{status="500"}': 1.0,
        "running": 3.0,
        'up{node="a"}': 1.0,
        'lat_bucket{le="0.1"}': 2.0,
        'lat_bucket{le="1.0"}': 2.0,
        'lat_bucket{le="+Inf"}': 2.0,
        "lat_sum": 0.05 + 0.1,
        "lat_count": 2.0,
    }
    assert "# TYPE lat histogram" in text and 'lat_bucket{le="0.1"} 2\n' in text
