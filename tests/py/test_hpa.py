"""tests/py/hpa.py (the HPA algorithm the autoscaling test applies) against cases transcribed
from Kubernetes' own controller tests, pkg/controller/podautoscaler/horizontal_test.go and
replica_calculator_test.go (the numbers of each case only; each row names its upstream test
function, and the case's name where that function is a table).  Pure Python, fast."""
from __future__ import annotations

import pytest

import hpa
from hpa import HPA, Policy, Rules, Tolerances


def rules(pods=0, pods_period=0, percent=0, percent_period=0, window=0, select="Max"):
    """Upstream's generateScalingRules(pods, podsPeriod, percent, percentPeriod, window)."""
    ps = []
    if pods:
        ps.append(Policy("Pods", pods, pods_period))
    if percent:
        ps.append(Policy("Percent", percent, percent_period))
    return Rules(window, select, tuple(ps))


def uniform_events(changes, period_s, now):
    """Upstream's generateEventsUniformDistribution: the events spread over the last
    period_s seconds, each in the middle of its segment."""
    seg = period_s / len(changes)
    return [hpa._Event(c, now - (period_s - seg * (i + 1) + seg / 2)) for i, c in enumerate(changes)]


NOW = 100000.0
LATER = NOW + 0.001  # upstream evaluates a moment after generating the events


# ------------------------------------------------- replica_calculator_test.go --

# (upstream test, current, usage, per-pod target, tolerances or None, expected)
AVERAGE_VALUE = [
    ("TestReplicaCalcScaleUpPerPodCMExternal", 3, 8600, 2150, None, 4),
    ("TestReplicaCalcScaleDownPerPodCMExternal", 5, 8600, 2867, None, 3),
    ("TestReplicaCalcTolerancePerPodCMExternal", 3, 8600, 2900, None, 3),
    ("TestReplicaCalcConfigurableTolerancePerPodCMExternal", 3, 8600, 2800, Tolerances(0.1, 0.01), 4),
    ("TestReplicaCalcScaleUpCMPerPodObject", 3, 20000, 5000, None, 4),
    ("TestReplicaCalcScaleDownPerPodCMObject", 5, 6000, 2000, None, 3),
    ("TestReplicaCalcTolerancePerPodCMObject", 4, 20166, 5000, None, 4),
    ("TestReplicaCalcConfigurableTolerancePerPodCMObject", 4, 20208, 5000, Tolerances(0.1, 0.01), 5),
    # horizontal_test.go, through the whole controller (min 2, max 6 do not bind)
    ("TestScaleUpPerPodCMExternal", 3, 8600, 2222, None, 4),
]


@pytest.mark.parametrize("name,current,usage,target,tol,want", AVERAGE_VALUE,
                         ids=[c[0] for c in AVERAGE_VALUE])
def test_average_value(name, current, usage, target, tol, want):
    assert hpa.average_value_replicas(current, usage, target, tol) == want


# (upstream test, current, ready pods (None: all), usage, target, tolerances, expected)
VALUE = [
    ("TestReplicaCalcScaleDownCMExternal", 5, None, 8600, 14334, None, 3),
    ("TestReplicaCalcToleranceCMExternal", 3, None, 8600, 8888, None, 3),
    ("TestReplicaCalcConfigurableToleranceCMExternal", 3, None, 8900, 8800, Tolerances(0.1, 0.01), 4),
    ("TestReplicaCalcScaleUpCMExternalIgnoresUnreadyPods", 3, 1, 8600, 4400, None, 2),
    ("TestReplicaCalcScaleUpCMObject", 3, None, 20000, 15000, None, 4),
    ("TestReplicaCalcScaleUpCMObjectIgnoresUnreadyPods", 3, 1, 50000, 10000, None, 5),
    ("TestReplicaCalcScaleDownCMObject", 5, None, 12000, 20000, None, 3),
    ("TestReplicaCalcToleranceCMObject", 3, None, 20666, 20000, None, 3),
    ("TestReplicaCalcConfigurableToleranceCMObject", 3, None, 20666, 20000, Tolerances(0.1, 0.01), 4),
    ("TestScaleUpCMExternal", 3, None, 8600, 6.666 * 1000, None, 4),  # horizontal_test.go
]


@pytest.mark.parametrize("name,current,ready,usage,target,tol,want", VALUE, ids=[c[0] for c in VALUE])
def test_value(name, current, ready, usage, target, tol, want):
    assert hpa.value_replicas(current, usage, target, ready, tol) == want


# (upstream test, current, per-pod values (None: no sample), pending, target, utilization?,
#  tolerances, expected).  Resource cases: values are each pod's utilization in percent.
PODS = [
    ("TestReplicaCalcScaleUpCM", 3, [20000, 10000, 30000], 0, 15000, False, None, 4),
    ("TestReplicaCalcScaleDownCM", 5, [12000] * 5, 0, 20000, False, None, 3),
    ("TestReplicaCalcToleranceCM", 3, [20000, 21000, 21000], 0, 20000, False, None, 3),
    ("TestReplicaCalcConfigurableToleranceCM", 3, [20000, 21000, 21000], 0, 20000, False,
     Tolerances(0.1, 0.01), 4),
    # a custom pods metric ignores readiness: the unready pod's sample counts
    ("TestReplicaCalcScaleUpCMUnreadyHotCpuNoLessScale", 3, [50000, 10000, 30000], 0, 15000, False, None, 6),
    ("TestReplicaCalcDuringRollingUpdateWithMaxSurgeCM", 2, [10000, 10000], 0, 17000, False, None, 2),
    # Resource utilization (requests 1.0 each, so mean utilization = upstream's ratio)
    ("TestReplicaCalcScaleDown", 5, [10, 30, 50, 25, 25], 0, 50, True, None, 3),
    ("TestReplicaCalcTolerance", 3, [1010 / 9, 103, 1020 / 11], 0, 100, True, None, 3),
    # the unready pod (here: pending) at 0 and the missing one at 0 on a scale-up
    ("TestReplicaCalcMissingMetricsUnreadyScaleUp", 3, [200, None], 1, 50, True, None, 4),
    # the missing pod at max(100 %, target) on a scale-down
    ("TestReplicaCalcMissingMetricsUnreadyScaleDown", 4, [10, 10, None], 1, 50, True, None, 3),
    # the missing pod would turn a scale-up into a scale-down: no change
    ("TestReplicaCalcMissingMetricsNoChangeGt", 2, [190, None], 0, 100, True, None, 2),
    ("TestReplicaCalcMissingMetricsNoChangeLt", 2, [60, None], 0, 100, True, None, 2),
    ("TestReplicaCalcMissingMetricsNoChangeEq", 2, [100, None], 0, 100, True, None, 2),
]


@pytest.mark.parametrize("name,current,values,pending,target,util,tol,want", PODS,
                         ids=[c[0] for c in PODS])
def test_pods(name, current, values, pending, target, util, tol, want):
    assert hpa.pods_replicas(current, values, target, pending, tol, util) == want


def test_pods_without_any_sample_is_invalid():
    # TestReplicaCalcEmptyMetrics: no sample at all is an error (an invalid metric)
    with pytest.raises(ValueError):
        hpa.pods_replicas(4, [None, None, None], 100, utilization=True)


def test_tolerance_per_direction():
    """TestReplicaCalcConfigurableTolerance (its table; utilization ratios 1.01, 1.90, 1.09,
    0.65, 0.65 against a target of 100 %, requests 0.9/1.0/1.1)."""
    for tol, ratio, want in [
        (Tolerances(0.0, 0.0), 1.01, 4),    # "Outside of a 0% tolerance"
        (Tolerances(0.1, 2.0), 1.90, 3),    # "Within a 200% scale-up tolerance"
        (Tolerances(2.0, 0.08), 1.09, 4),   # "Outside 8% scale-up tolerance ..."
        (Tolerances(0.36, 0.1), 0.65, 3),   # "Within a 36% scale-down tolerance"
        (Tolerances(0.34, 0.1), 0.65, 2),   # "Outside a 34% scale-down tolerance"
    ]:
        assert hpa.usage_ratio_replicas(3, ratio, None, tol) == want, (tol, ratio)


# ------------------------------------------------------- select max over metrics --

def test_select_max_and_invalid_metrics():
    # TestScaleUpOneMetricInvalid: CPU 300/400/500 m of 1.0 at target 30 % -> 4; the other
    # metric is invalid; a scale-up goes ahead (min 2, max 6)
    cpu = hpa.pods_replicas(3, [30, 40, 50], 30, utilization=True)
    assert cpu == 4
    assert hpa.max_over_metrics(3, [cpu, None]) == 4
    # TestScaleUpOneMetricEmpty: the same with the external metric failing
    assert hpa.max_over_metrics(3, [cpu, None]) == 4
    # TestNoScaleDownOneMetricInvalid / TestNoScaleDownOneMetricEmpty: CPU alone says 3
    # (100/300/500/250/250 m at 50 %), the other metric is invalid: no scale-down
    cpu = hpa.pods_replicas(5, [10, 30, 50, 25, 25], 50, utilization=True)
    assert cpu == 3
    assert hpa.max_over_metrics(5, [cpu, None]) == 5
    # TestScaleDown: CPU alone, valid -> 3
    h = HPA(2, 6)
    assert h.desired(5, hpa.max_over_metrics(5, [cpu]), NOW) == 3
    # the largest proposal wins (the decode pool's two triggers: KV usage and waiting requests)
    assert hpa.max_over_metrics(2, [1, 4, 3]) == 4
    assert hpa.max_over_metrics(2, [None, None]) == 2


def test_scale_down_with_scaling_rules():
    # TestScaleDownWithScalingRules: user scale-up rules only; CPU says 3 of 5 -> 3
    h = HPA(2, 6, scale_up=rules(0, 0, 100, 15, 30))
    assert h.desired(5, 3, NOW) == 3


def test_defaults():
    # SetDefaults / GenerateHPAScale{Up,Down}Rules
    up, down = hpa.scale_up_rules(), hpa.scale_down_rules()
    assert up.stabilization_window_seconds == 0 and up.select_policy == "Max"
    assert {(p.type, p.value, p.period_seconds) for p in up.policies} == {("Percent", 100, 15), ("Pods", 4, 15)}
    assert down.stabilization_window_seconds == 300 and down.select_policy == "Max"
    assert [(p.type, p.value, p.period_seconds) for p in down.policies] == [("Percent", 100, 15)]
    # a user's field replaces the default, the others stay
    r = hpa.scale_down_rules(Rules(stabilization_window_seconds=60))
    assert r.stabilization_window_seconds == 60 and r.policies == down.policies


# ------------------------------------------------------------ horizontal_test.go --

# TestScalingWithRules (convertDesiredReplicasWithBehaviorRate): (case name, min, max,
# scale-up rules, scale-down rules, scale-up events, scale-down events (changes spread over
# the last 120 s), current, prenormalized desired, expected, condition)
D = None
SCALING_WITH_RULES = [
    ("prenormalized desired replicas within range", 3, 8, D, D, D, D, 5, 7, 7, "DesiredWithinRange"),
    ("prenormalized desired replicas < minReplicas", 2, 8, D, D, D, D, 3, 1, 2, "TooFewReplicas"),
    ("maxReplicas is the limit because maxReplicas < scaleUpLimit", 1, 10, D, D, D, D, 20, 1000, 10,
     "TooManyReplicas"),
    ("scaleUpLimit is the limit because scaleUpLimit < maxReplicas with user policies", 1, 2000,
     rules(0, 0, 1, 60), D, D, D, 3, 1000, 4, "ScaleUpLimit"),
    ("scaleUp with default behavior", 1, 1000, D, D, D, D, 10, 50, 20, "ScaleUpLimit"),
    ("scaleUp with pods policy larger than percent policy", 1, 1000, rules(100, 60, 100, 60), D, D, D,
     10, 500, 110, "ScaleUpLimit"),
    ("scaleUp with percent policy larger than pods policy", 1, 1000, rules(2, 60, 100, 60), D, D, D,
     10, 500, 20, "ScaleUpLimit"),
    ("scaleUp with pod policy limitation", 1, 1000, rules(30, 60), D, D, D, 10, 50, 40, "ScaleUpLimit"),
    ("scaleUp with percent policy limitation", 1, 1000, rules(0, 0, 200, 60), D, D, D, 10, 50, 30,
     "ScaleUpLimit"),
    ("scaleDown with percent policy larger than pod policy", 1, 1000, D, rules(20, 60, 1, 60, 300), D, D,
     100, 2, 80, "ScaleDownLimit"),
    ("scaleDown with pod policy larger than percent policy", 1, 1000, D, rules(2, 60, 1, 60, 300), D, D,
     100, 2, 98, "ScaleDownLimit"),
    ("scaleDown with spec MinReplicas limitation with large percent policy", 5, 1000, D,
     rules(0, 0, 100, 60, 300), D, D, 10, 2, 5, "TooFewReplicas"),
    ("scaleDown with pod policy limitation", 1, 1000, D, rules(5, 60, 0, 0, 300), D, D, 10, 2, 5,
     "ScaleDownLimit"),
    ("scaleDown with percent policy limitation", 1, 1000, D, rules(0, 0, 50, 60, 300), D, D, 10, 5, 5,
     "DesiredWithinRange"),
    ("scaleUp with spec MaxReplicas limitation with large pod policy and events", 1, 200,
     rules(300, 60), D, [1, 5, 9], D, 100, 500, 200, "TooManyReplicas"),
    ("scaleUp with currentReplicas limitation with rate.PeriodSeconds with a lot of recent scale up events",
     1, 1000, rules(5, 120), D, [1, 5, 9], D, 100, 500, 100, "ScaleUpLimit"),
    ("scaleUp with pod policy and previous scale up events", 1, 1000, rules(150, 120), D, [1, 5, 9], D,
     100, 500, 235, "ScaleUpLimit"),
    ("scaleUp with percent policy and previous scale up events", 1, 1000, rules(0, 0, 200, 120), D,
     [1, 5, 9], D, 100, 500, 255, "ScaleUpLimit"),
    ("scaleUp with percent policy and previous scale up and down events", 1, 1000, rules(0, 0, 300, 300),
     D, [4], [2], 6, 24, 16, "ScaleUpLimit"),
    ("scaleDown with default policy and previous events", 1, 1000, D, D, D, [1, 5, 9], 10, 5, 5,
     "DesiredWithinRange"),
    ("scaleDown with spec MinReplicas limitation with large pod policy and previous events", 5, 1000, D,
     rules(130, 120, 0, 0, 300), D, [1, 5, 9], 100, 0, 5, "TooFewReplicas"),
    ("scaleDown with pod policy limitation and previous events", 1, 1000, D, rules(5, 120, 0, 0, 300), D,
     [1, 5, 9], 100, 2, 100, "ScaleDownLimit"),
    ("scaleDown with percent policy limitation and previous events", 1, 1000, D,
     rules(0, 0, 50, 120, 300), D, [2, 4, 6], 100, 0, 56, "ScaleDownLimit"),
    ("scaleDown with percent policy and previous scale up and down events", 1, 1000, D,
     rules(0, 0, 50, 180, 0), [2], [4], 10, 1, 6, "ScaleDownLimit"),
    ("scaleDown with previous events preventing further scale down", 1, 1000, D,
     rules(0, 0, 10, 120, 300), D, [10, 10, 10], 100, 0, 100, "ScaleDownLimit"),
    ("scaleDown with with previous events still allowing more scale down", 1, 1000, D,
     rules(0, 0, 1000, 120, 300), D, [10, 10, 10], 10, 5, 5, "DesiredWithinRange"),
    ("check that events were marked 'outdated' for two different policies in the behavior for up", 1,
     1000, rules(1000, 30, 100, 60), D, [8, 12, 9, 11], D, 100, 200, 200, "DesiredWithinRange"),
    ("check that events were not marked 'outdated' for two different policies in the behavior for down",
     1, 1000, D, rules(1000, 120, 100, 60, 300), D, [8, 12, 9, 11], 100, 5, 5, "DesiredWithinRange"),
]


@pytest.mark.parametrize("case", SCALING_WITH_RULES, ids=[c[0] for c in SCALING_WITH_RULES])
def test_scaling_with_rules(case):
    name, lo, hi, up, down, up_ev, down_ev, current, desired, want, cond = case
    h = HPA(lo, hi, scale_up=up, scale_down=down)
    h.up_events = uniform_events(up_ev, 120, NOW) if up_ev else []
    h.down_events = uniform_events(down_ev, 120, NOW) if down_ev else []
    assert h.limit(current, desired, LATER) == (want, cond)


def test_select_policy_min_and_disabled():
    # TestCalculateScaleDownLimitWithBehaviors-style: Min picks the smallest change
    two = (Policy("Pods", 2, 60), Policy("Percent", 50, 60))
    h = HPA(1, 1000, scale_down=Rules(300, "Min", two), scale_up=Rules(0, "Min", two))
    assert h.scale_down_limit(5, NOW) == 3   # min change: 5 - 2 = 3 (50 %: 2)
    assert h.scale_up_limit(5, NOW) == 7     # min change: 5 + 2 = 7 (50 %: 8)
    h = HPA(1, 1000, scale_down=Rules(300, "Max", two), scale_up=Rules(0, "Max", two))
    assert h.scale_down_limit(5, NOW) == 2   # max change: int(5 * 0.5) = 2
    assert h.scale_up_limit(5, NOW) == 8     # max change: ceil(5 * 1.5) = 8
    h = HPA(1, 1000, scale_down=Rules(300, "Disabled", two), scale_up=Rules(0, "Disabled", two))
    assert h.limit(5, 1, NOW) == (5, "ScaleDownLimit")
    assert h.limit(5, 9, NOW) == (5, "ScaleUpLimit")


# TestNormalizeDesiredReplicasWithBehavior (stabilizeRecommendationWithBehaviors): (case name,
# recommendations [(replicas, minutes ago)], current, desired, scale-up window s, scale-down
# window s, expected)
STABILIZE = [
    ("empty recommendations for scaling down", [], 100, 5, 0, 0, 5),
    ("simple scale down stabilization", [(4, 2), (5, 1)], 100, 3, 0, 180, 5),
    ("simple scale up stabilization", [(4, 2), (5, 1)], 1, 7, 300, 0, 4),
    ("no scale down stabilization", [(1, 2), (2, 1)], 100, 3, 300, 0, 3),
    ("no scale up stabilization", [(4, 2), (5, 1)], 1, 3, 0, 300, 3),
    ("no scale down stabilization, reuse recommendation element", [(10, 10), (9, 9)], 100, 3, 0, 0, 3),
    ("no scale up stabilization, reuse recommendation element", [(10, 10), (9, 9)], 1, 100, 0, 0, 100),
    ("scale down stabilization, reuse one of obsolete recommendation element",
     [(10, 10), (4, 1), (5, 2), (9, 9)], 100, 3, 0, 180, 5),
    ("scale up stabilization, reuse one of obsolete recommendation element",
     [(10, 100), (6, 1), (5, 2), (9, 3)], 1, 100, 300, 0, 5),
    ("scale up and down stabilization, do not scale up when prenormalized rec goes down",
     [(2, 100), (3, 3)], 2, 1, 300, 300, 2),
    ("scale up and down stabilization, do not scale down when prenormalized rec goes up",
     [(2, 100), (1, 3)], 2, 3, 300, 300, 2),
]


@pytest.mark.parametrize("case", STABILIZE, ids=[c[0] for c in STABILIZE])
def test_stabilization(case):
    name, recs, current, desired, up_w, down_w, want = case
    h = HPA(1, 1000, scale_up=Rules(stabilization_window_seconds=up_w),
            scale_down=Rules(stabilization_window_seconds=down_w))
    h.recommendations = [(r, NOW - 60 * m) for r, m in recs]
    assert h.stabilize(current, desired, NOW) == want
    assert h.recommendations[-1] == (desired, NOW)  # the raw recommendation is recorded


# ------------------------------------------------- the controller over time (ours) --

def test_compressed_clock_sequence():
    """Not upstream: the whole reconcile loop on a compressed clock (1 s = 10 HPA s), with the
    behaviour test_autoscale.py uses.  Scale-up is immediate and limited by the policies;
    scale-down waits for the window, then goes one pod per period."""
    h = HPA(1, 4, time_scale=10,
            scale_up=Rules(0, "Max", (Policy("Pods", 2, 15), Policy("Percent", 100, 15))),
            scale_down=Rules(60, "Max", (Policy("Pods", 1, 15),)))
    t, n = 0.0, 1
    n = h.desired(n, 9, t)
    assert n == 3  # max(1 + 2 pods, 1 * 200 %) = 3
    t += 1.0  # 10 HPA s later: the period (15 s) still holds the +2
    assert h.desired(n, 9, t) == 3
    t += 0.6  # 16 HPA s after the first: a new period
    n = h.desired(n, 9, t)
    assert n == 4  # clamped to maxReplicas
    # the load is gone: proposals of 1 for the 60 HPA s window (6 s here): no change
    while t < 1.6 + 5.9:
        t += 0.5
        assert h.desired(n, 1, t) == 4
    t = 1.6 + 6.1  # the last 9 left the window
    n = h.desired(n, 1, t)
    assert n == 3
    assert h.desired(n, 1, t + 1.0) == 3  # 1 pod per 15 HPA s
    n = h.desired(n, 1, t + 1.6)
    assert n == 2
    assert h.desired(n, 0, t + 3.2) == 1 and h.desired(1, 0, t + 9) == 1  # min 1


def test_out_of_range_and_disabled():
    h = HPA(2, 5)
    assert h.desired(1, None, NOW) == 2   # below minReplicas: min, whatever the metrics
    assert h.desired(7, 1, NOW) == 5      # above maxReplicas: max
    assert h.desired(0, 9, NOW) == 0      # scaled to 0 by hand with minReplicas > 0: disabled
    assert h.desired(3, None, NOW) == 3   # no valid metric: no change
    with pytest.raises(ValueError):
        HPA(3, 2)
