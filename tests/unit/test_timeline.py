"""A request's timeline: where its first step went, in ms and steps since the connector saw it."""

from __future__ import annotations

from connector.core.timeline import Timeline


def test_marks_are_relative_to_first_sight_in_pass_order_and_keep_their_first_pass():
    timeline = Timeline.start(10.0, 5, arrived_ago_s=0.002)
    timeline.mark("computing", 10.020, 7)
    timeline.mark("answered", 10.001, 5)
    timeline.mark("load_done", 10.010, 6)
    timeline.mark("load_sent", 10.0015, 5)
    timeline.mark("computing", 10.500, 40)  # a preempted request scheduled again keeps its first
    assert timeline.to_dict() == {
        "arrived": [-2.0, 0],
        "answered": [1.0, 0],
        "load_sent": [1.5, 0],
        "load_done": [10.0, 1],
        "computing": [20.0, 2],
    }
    assert list(timeline.to_dict()) == ["arrived", "answered", "load_sent", "load_done", "computing"]


def test_an_unknown_or_future_arrival_is_left_out():
    assert "arrived" not in Timeline.start(1.0, 0, None).to_dict()
    assert "arrived" not in Timeline.start(1.0, 0, -0.5).to_dict()  # clocks disagree: no fake figure
