"""Unit tests of the P2C picker, staleness-weighted load, ejection and draining."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from serving.balancer import (
    Backend,
    Balancer,
    BalancerConfig,
    backoff,
    begin_report,
    note_sent,
    record_report,
    report_weight,
    score,
)


def make(n: int, seed: int = 1, **cfg) -> Balancer:
    bal = Balancer(BalancerConfig(**cfg), rng=random.Random(seed))
    for i in range(n):
        bal.add(f"http://127.0.0.1:{9000 + i}")
    return bal


def test_report_weight_decays_with_age_and_stops_at_max_age():
    cfg = BalancerConfig(report_half_life_s=1.0, report_max_age_s=5.0)
    assert report_weight(0.0, cfg) == 1.0
    assert report_weight(1.0, cfg) == pytest.approx(0.5)
    assert report_weight(2.0, cfg) == pytest.approx(0.25)
    assert report_weight(5.0, cfg) == 0.0
    assert report_weight(-1.0, cfg) == 1.0  # clock skew is not a bonus


def test_score_combines_own_inflight_with_decayed_others_share():
    cfg = BalancerConfig(report_half_life_s=1.0)
    b = Backend("http://x")
    b.inflight = 2
    record_report(b, 10.0, now=100.0)  # 10 reported, 2 of them ours: others = 8
    assert score(b, 100.0, cfg) == pytest.approx(10.0)
    assert score(b, 101.0, cfg) == pytest.approx(2 + 4.0)
    b.inflight = 5  # our own counts are always current
    assert score(b, 101.0, cfg) == pytest.approx(5 + 4.0)
    assert score(b, 200.0, cfg) == pytest.approx(5.0)  # stale report ignored


def test_p2c_prefers_less_loaded_of_two():
    bal = make(2)
    a, b = bal.backends.values()
    a.inflight = 3
    for _ in range(20):
        assert bal.pick(0.0) is b


def test_p2c_never_picks_the_most_loaded_of_three():
    bal = make(3)
    bs = list(bal.backends.values())
    bs[0].inflight, bs[1].inflight, bs[2].inflight = 0, 1, 9
    picks = Counter(bal.pick(0.0).url for _ in range(3000))
    assert bs[2].url not in picks
    assert picks[bs[0].url] > picks[bs[1].url]


def test_p2c_uses_reported_load_of_other_routers():
    bal = make(2)
    a, b = bal.backends.values()
    record_report(a, 50.0, now=0.0)  # busy from other routers' traffic
    assert all(bal.pick(0.1) is b for _ in range(20))
    # a minute later the report is worthless and ties are broken at random
    picks = Counter(bal.pick(60.0).url for _ in range(2000))
    assert 800 < picks[a.url] < 1200


def test_ties_spread_evenly():
    bal = make(4)
    picks = Counter(bal.pick(0.0).url for _ in range(8000))
    assert len(picks) == 4
    assert min(picks.values()) > 1600


def test_ejection_backoff_doubles_and_caps():
    cfg = BalancerConfig(eject_base_s=1.0, eject_max_s=8.0)
    rng = random.Random(0)
    assert 0.9 <= backoff(1, cfg, rng) <= 1.1
    assert 1.8 <= backoff(2, cfg, rng) <= 2.2
    assert 7.2 <= backoff(10, cfg, rng) <= 8.8
    assert 7.2 <= backoff(10_000, cfg, rng) <= 8.8


def test_ejected_backend_gets_no_requests_until_backoff_ends():
    bal = make(3, eject_base_s=1.0)
    bad = next(iter(bal.backends.values()))
    assert bal.on_failure(bad, now=10.0)
    assert all(bal.pick(10.5) is not bad for _ in range(200))
    assert any(bal.pick(11.2) is bad for _ in range(200))
    # a second failure on probation ejects for twice as long
    assert bal.on_failure(bad, now=11.2)
    assert all(bal.pick(12.5) is not bad for _ in range(200))
    bal.on_success(bad)
    assert bad.failures == 0


def test_eject_after_several_failures():
    bal = make(2, eject_after_failures=3)
    b = next(iter(bal.backends.values()))
    assert not bal.on_failure(b, 0.0)
    assert not bal.on_failure(b, 0.0)
    assert bal.on_failure(b, 0.0)
    assert b.ejections == 1


def test_all_ejected_falls_back_to_soonest_recovery():
    bal = make(2)
    a, b = bal.backends.values()
    bal.on_failure(a, now=0.0)
    bal.on_failure(b, now=0.0)
    bal.on_failure(b, now=0.0)  # b ejected longer
    assert bal.pick(0.1) is a


def test_retry_excludes_the_failed_backend():
    for n in (2, 3, 5):
        bal = make(n)
        first = bal.pick(0.0)
        for _ in range(200):
            other = bal.pick(0.0, exclude=first)
            assert other is not None and other is not first
    bal = make(1)
    only = bal.pick(0.0)
    assert bal.pick(0.0, exclude=only) is None


def test_retry_exclude_draws_uniformly_from_the_rest():
    bal = make(4, seed=3)
    bs = list(bal.backends.values())
    picks = Counter(bal.pick(0.0, exclude=bs[1]).url for _ in range(6000))
    assert bs[1].url not in picks
    assert min(picks.values()) > 1500


def test_draining_backend_gets_no_new_requests_and_is_reaped_when_idle():
    bal = make(2)
    a, b = bal.backends.values()
    a.inflight = 1
    bal.drain(a.url)
    assert all(bal.pick(0.0) is b for _ in range(50))
    assert bal.reap() == []
    a.inflight = 0
    assert bal.reap() == [a.url]
    assert a.url not in bal.backends


def test_set_endpoints_adds_drains_and_undrains():
    bal = Balancer(rng=random.Random(0))
    bal.set_endpoints([("http://a", "z1"), ("http://b", "z2")], [])
    assert set(bal.backends) == {"http://a", "http://b"}
    bal.backends["http://a"].inflight = 2
    bal.set_endpoints([("http://b", "z2")], ["http://a", "http://never-seen"])
    assert bal.backends["http://a"].draining
    assert "http://never-seen" not in bal.backends
    bal.set_endpoints([("http://a", "z1"), ("http://b", "z2")], [])
    assert not bal.backends["http://a"].draining
    bal.backends["http://a"].inflight = 0
    bal.set_endpoints([("http://b", "z2")], [])  # vanished and idle: gone at once
    assert set(bal.backends) == {"http://b"}


def test_no_backends_returns_none():
    assert Balancer().pick(0.0) is None


def test_report_subtracts_our_peak_in_flight_during_the_scrape():
    cfg = BalancerConfig()
    b = Backend("http://x")
    b.inflight = 3
    begin_report(b)
    note_sent(b)
    note_sent(b)  # 5 at the peak, while the backend counted us
    b.inflight -= 4  # answers arrive before the report does
    record_report(b, 5.0, now=0.0, own=max(b.peak, b.inflight))
    # without the peak, 5 - 1 = 4 phantom requests "from other routers" would be scored
    assert score(b, 0.0, cfg) == pytest.approx(1.0)


def zoned(zones: str, seed: int = 1, **cfg) -> Balancer:
    bal = Balancer(BalancerConfig(zone="a", **cfg), rng=random.Random(seed))
    for i, z in enumerate(zones):
        bal.add(f"http://127.0.0.1:{9000 + i}", zone=z)
    return bal


def test_zone_preference_keeps_traffic_local_while_healthy():
    bal = zoned("aabbb")
    per = Counter(bal.pick(0.0).zone for _ in range(500))
    assert per == {"a": 500}
    # no preference configured: everyone gets a share
    plain = make(5)
    assert len({plain.pick(0.0).url for _ in range(200)}) == 5


def test_zone_preference_ends_when_too_few_local_backends_are_eligible():
    bal = zoned("aabbb")
    a0 = next(b for b in bal.backends.values() if b.zone == "a")
    bal.on_failure(a0, 0.0)  # one of two ejected: 50% still eligible, still preferred
    assert {bal.pick(0.1).zone for _ in range(200)} == {"a"}
    bal = zoned("aaabb")
    for b in [b for b in bal.backends.values() if b.zone == "a"][:2]:
        bal.on_failure(b, 0.0)  # 1 of 3 eligible: below half, spread over all
    per = Counter(bal.pick(0.1).zone for _ in range(300))
    assert per["b"] > 150
    bal = zoned("bbb")  # no backend in our zone at all
    assert {bal.pick(0.0).zone for _ in range(50)} == {"b"}


def test_zone_preference_spills_to_a_much_less_loaded_zone():
    bal = zoned("aabb")
    for b in bal.backends.values():
        b.inflight = 10 if b.zone == "a" else 8  # 10 <= 1.5 * 8 + 4: stay
    assert {bal.pick(0.0).zone for _ in range(200)} == {"a"}
    for b in bal.backends.values():
        b.inflight = 20 if b.zone == "a" else 8  # 20 > 16: a sampled "b" wins
    per = Counter(bal.pick(0.0).zone for _ in range(400))
    assert 120 < per["b"] < 280  # about half the draws sample the other zone


def test_retries_ignore_the_zone():
    bal = zoned("ab")
    a, b = bal.backends.values()
    assert {bal.pick(0.0, exclude=a).url for _ in range(20)} == {b.url}
