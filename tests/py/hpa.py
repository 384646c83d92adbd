"""The Kubernetes HorizontalPodAutoscaler algorithm (autoscaling/v2), as a small pure module.

Follows kube-controller-manager's pkg/controller/podautoscaler (horizontal.go,
replica_calculator.go) so the local autoscaling test (test_autoscale.py) scales the pools the
way a real HPA (or KEDA, which feeds the same controller) would.  test_hpa.py checks it against
cases transcribed from upstream's own controller tests.

What is here:
- per-metric proposals (replica_calculator.go):
    * external / object metric, target Value:        ceil(usage / target * ready_pods)
    * external / object metric, target AverageValue: ceil(usage / target)
      (tolerance checked on usage / (target * current))
    * pods metric (per-pod values), target AverageValue, and resource Utilization (per-pod
      utilization in percent of the request): ceil(mean / target * pods), with upstream's
      missing-pod and pending-pod rules (below);
  no change while the ratio is within the tolerance (default 0.1; per direction when a
  behavior sets scaleUp/scaleDown tolerance, as upstream's configurable tolerance does).
- several metrics: the largest proposal wins; an invalid (missing) metric blocks a scale-down
  and is ignored for a scale-up; all invalid: no change (computeReplicasForMetrics).
- behavior (normalizeDesiredReplicasWithBehaviors): stabilization (scale-up: the lowest
  recommendation in the scale-up window, scale-down: the highest in the scale-down window, the
  current count kept in between), then the scaling policies (Pods / Percent per periodSeconds,
  selectPolicy Max / Min / Disabled) against the scale events of the period, then
  minReplicas / maxReplicas.  Defaults (autoscaling/v2 SetDefaults): scaleUp window 0,
  policies max(100 %, 4 pods) per 15 s; scaleDown window 300 s, policy 100 % per 15 s.
- current < minReplicas goes to minReplicas, current > maxReplicas to maxReplicas, without
  looking at metrics; current == 0 with minReplicas > 0 is "scaling disabled" (kept at 0).

Simplified (said here so nobody relies on it): there is no CPU initialization period or
readiness delay (upstream ignores the CPU samples of pods that just started); a pod is either
ready with a sample, "missing" (running, no sample), or "pending" (not started: counted as
unready).  Pods being deleted are the caller's to leave out.  Times are plain float seconds
from a clock the caller passes (`now`), so a test can compress time: divide every window and
period by the same factor (see `HPA(..., time_scale=...)`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

DEFAULT_TOLERANCE = 0.1
DEFAULT_DOWNSCALE_STABILIZATION_S = 300  # --horizontal-pod-autoscaler-downscale-stabilization
SYNC_PERIOD_S = 15  # --horizontal-pod-autoscaler-sync-period


# ------------------------------------------------------------------ behavior --

@dataclass(frozen=True)
class Policy:
    type: str  # "Pods" or "Percent"
    value: int
    period_seconds: int

    def __post_init__(self):
        if self.type not in ("Pods", "Percent"):
            raise ValueError(f"policy type {self.type!r}: Pods or Percent")
        if self.value <= 0 or self.period_seconds <= 0:
            raise ValueError("policy value and periodSeconds must be > 0")


@dataclass(frozen=True)
class Rules:
    """One direction of spec.behavior (HPAScalingRules); None fields take the defaults."""
    stabilization_window_seconds: Optional[int] = None
    select_policy: Optional[str] = None  # "Max" (default), "Min", "Disabled"
    policies: Optional[Sequence[Policy]] = None
    tolerance: Optional[float] = None  # None: the controller's --horizontal-pod-autoscaler-tolerance


SCALE_UP_DEFAULT = Rules(0, "Max", (Policy("Percent", 100, 15), Policy("Pods", 4, 15)))
SCALE_DOWN_DEFAULT = Rules(None, "Max", (Policy("Percent", 100, 15),))


def _fill(rules: Optional[Rules], default: Rules) -> Rules:
    """GenerateHPAScale{Up,Down}Rules: the user's fields over the defaults."""
    if rules is None:
        return default
    out = default
    for f in ("stabilization_window_seconds", "select_policy", "policies", "tolerance"):
        v = getattr(rules, f)
        if v is not None:
            out = replace(out, **{f: v})
    return out


def scale_up_rules(rules: Optional[Rules] = None) -> Rules:
    return _fill(rules, SCALE_UP_DEFAULT)


def scale_down_rules(rules: Optional[Rules] = None,
                     default_window_s: int = DEFAULT_DOWNSCALE_STABILIZATION_S) -> Rules:
    r = _fill(rules, SCALE_DOWN_DEFAULT)
    if r.stabilization_window_seconds is None:  # maybeInitScaleDownStabilizationWindow
        r = replace(r, stabilization_window_seconds=default_window_s)
    return r


# ------------------------------------------------------------------ tolerance --

@dataclass(frozen=True)
class Tolerances:
    scale_down: float = DEFAULT_TOLERANCE
    scale_up: float = DEFAULT_TOLERANCE

    def within(self, ratio: float) -> bool:
        """No change for this usage ratio (upstream's Tolerances.isWithin)."""
        return (1.0 - self.scale_down) <= ratio <= (1.0 + self.scale_up)


def _tol(t) -> Tolerances:
    if t is None:
        return Tolerances()
    if isinstance(t, Tolerances):
        return t
    return Tolerances(float(t), float(t))


# --------------------------------------------------- per-metric replica proposals --

def _ceil(x: float) -> int:
    # float noise (e.g. 3 * 0.1 / 0.1) must not add a replica
    r = round(x)
    return int(r) if abs(x - r) < 1e-9 else math.ceil(x)


def usage_ratio_replicas(current: int, ratio: float, ready: Optional[int] = None,
                         tolerance=None) -> int:
    """getUsageRatioReplicaCount: a whole-target metric (external or object, target Value)."""
    if current == 0:
        return _ceil(ratio)  # scale from zero: no tolerance
    if _tol(tolerance).within(ratio):
        return current
    return _ceil(ratio * (current if ready is None else ready))


def value_replicas(current: int, usage: float, target: float, ready: Optional[int] = None,
                   tolerance=None) -> int:
    """External or Object metric with target type Value: ratio usage/target times the ready
    pods (GetExternalMetricReplicas, GetObjectMetricReplicas)."""
    return usage_ratio_replicas(current, usage / target, ready, tolerance)


def average_value_replicas(current: int, usage: float, target_per_pod: float,
                           tolerance=None) -> int:
    """External or Object metric with target type AverageValue: the metric's total divided by
    the per-replica target (GetExternalPerPodMetricReplicas, GetObjectPerPodMetricReplicas).
    The tolerance is checked on usage / (target * current)."""
    if current == 0:
        return _ceil(usage / target_per_pod)
    ratio = usage / (target_per_pod * current)
    if _tol(tolerance).within(ratio):
        return current
    return _ceil(usage / target_per_pod)


def pods_replicas(current: int, values: Sequence[Optional[float]], target: float,
                  pending: int = 0, tolerance=None, utilization: bool = False) -> int:
    """Pods metric (target AverageValue) or Resource Utilization (values in percent of the
    request, target the utilization): calcPlainMetricReplicas.

    values: one entry per running pod, None for a pod with no sample ("missing");
    pending: pods not started yet (counted unready); utilization: a Resource Utilization
    metric, whose missing pods count at max(100 %, target) on a scale-down (upstream's
    fallback), where a pods metric's count at the target.  Raises ValueError with no sample at
    all (upstream: an error, the metric is invalid)."""
    tol = _tol(tolerance)
    have = [v for v in values if v is not None]
    missing = len(values) - len(have)
    if not have:
        raise ValueError("no metrics returned for any pod")
    ratio = (sum(have) / len(have)) / target
    scale_up_with_unready = pending > 0 and ratio > 1.0
    if not scale_up_with_unready and missing == 0:
        if tol.within(ratio):
            return current
        return _ceil(ratio * len(have))
    filled = list(have)
    if missing and ratio != 1.0:
        # scale-down: missing pods at the target; scale-up: missing pods at 0
        down = max(100.0, target) if utilization else target
        filled += [down if ratio < 1.0 else 0.0] * missing
    if scale_up_with_unready:
        filled += [0.0] * pending
    new_ratio = (sum(filled) / len(filled)) / target
    if tol.within(new_ratio) or (ratio < 1.0 < new_ratio) or (ratio > 1.0 > new_ratio):
        return current
    new = _ceil(new_ratio * len(filled))
    if (new_ratio < 1.0 and new > current) or (new_ratio > 1.0 and new < current):
        return current
    return new


def max_over_metrics(current: int, proposals: Sequence[Optional[int]]) -> int:
    """computeReplicasForMetrics: the largest proposal; None is an invalid metric.  All invalid,
    or some invalid and the valid ones would scale down: no change (current)."""
    valid = [p for p in proposals if p is not None]
    if not valid:
        return current
    best = max(valid)
    if len(valid) < len(proposals) and best < current:
        return current
    return best


# ------------------------------------------------------------------- controller --

@dataclass
class _Event:
    change: int
    t: float


@dataclass
class HPA:
    """One HorizontalPodAutoscaler's controller state: its recommendations and scale events.

    time_scale: HPA seconds per caller second (10: every window and period is divided by 10,
    the compressed clock of test_autoscale.py).  Every method takes `now` in caller seconds."""
    min_replicas: int
    max_replicas: int
    scale_up: Optional[Rules] = None
    scale_down: Optional[Rules] = None
    time_scale: float = 1.0
    default_downscale_window_s: int = DEFAULT_DOWNSCALE_STABILIZATION_S
    recommendations: list = field(default_factory=list)  # [(replicas, t)]
    up_events: list = field(default_factory=list)
    down_events: list = field(default_factory=list)

    def __post_init__(self):
        if self.min_replicas < 0 or self.max_replicas < max(self.min_replicas, 1):
            raise ValueError("need 0 <= minReplicas <= maxReplicas, maxReplicas >= 1")
        self.up = scale_up_rules(self.scale_up)
        self.down = scale_down_rules(self.scale_down, self.default_downscale_window_s)

    def seconds(self, hpa_seconds: float) -> float:
        """A duration of the HPA's spec in the caller's clock."""
        return hpa_seconds / self.time_scale

    def tolerances(self, default: float = DEFAULT_TOLERANCE) -> Tolerances:
        """The tolerance per direction: a behavior's own, else the controller's."""
        return Tolerances(default if self.down.tolerance is None else self.down.tolerance,
                          default if self.up.tolerance is None else self.up.tolerance)

    # -- stabilizeRecommendationWithBehaviors
    def stabilize(self, current: int, desired: int, now: float) -> int:
        up_cut = now - self.seconds(self.up.stabilization_window_seconds)
        down_cut = now - self.seconds(self.down.stabilization_window_seconds)
        up_rec = down_rec = desired
        for rec, t in self.recommendations:
            if t > up_cut:
                up_rec = min(rec, up_rec)
            if t > down_cut:
                down_rec = max(rec, down_rec)
        # forget what no window can see any more (upstream reuses one such slot)
        self.recommendations = [(r, t) for r, t in self.recommendations
                                if t >= up_cut or t >= down_cut]
        self.recommendations.append((desired, now))
        return min(max(current, up_rec), down_rec)

    # -- getReplicasChangePerPeriod
    def _changed(self, events, period_s: int, now: float) -> int:
        cut = now - self.seconds(period_s)
        return sum(e.change for e in events if e.t > cut)

    # -- calculateScaleUpLimitWithScalingRules
    def scale_up_limit(self, current: int, now: float) -> int:
        r = self.up
        if r.select_policy == "Disabled":
            return current
        pick = min if r.select_policy == "Min" else max
        result = None
        for p in r.policies:
            start = (current - self._changed(self.up_events, p.period_seconds, now)
                     + self._changed(self.down_events, p.period_seconds, now))
            proposed = (start + p.value if p.type == "Pods"
                        else math.ceil(start * (1 + p.value / 100)))
            result = proposed if result is None else pick(result, proposed)
        return current if result is None else result

    # -- calculateScaleDownLimitWithBehaviors
    def scale_down_limit(self, current: int, now: float) -> int:
        r = self.down
        if r.select_policy == "Disabled":
            return current
        pick = max if r.select_policy == "Min" else min
        result = None
        for p in r.policies:
            start = (current - self._changed(self.up_events, p.period_seconds, now)
                     + self._changed(self.down_events, p.period_seconds, now))
            proposed = (start - p.value if p.type == "Pods"
                        else int(start * (1 - p.value / 100)))  # Go int32(): truncation
            result = proposed if result is None else pick(result, proposed)
        return current if result is None else result

    # -- convertDesiredReplicasWithBehaviorRate: (replicas, condition)
    def limit(self, current: int, desired: int, now: float):
        if desired > current:
            lim = max(self.scale_up_limit(current, now), current)
            if self.max_replicas > lim:
                top, why = lim, "ScaleUpLimit"
            else:
                top, why = self.max_replicas, "TooManyReplicas"
            if desired > top:
                return top, why
        elif desired < current:
            lim = min(self.scale_down_limit(current, now), current)
            if self.min_replicas < lim:
                bottom, why = lim, "ScaleDownLimit"
            else:
                bottom, why = self.min_replicas, "TooFewReplicas"
            if desired < bottom:
                return bottom, why
        return desired, "DesiredWithinRange"

    def record(self, prev: int, new: int, now: float):
        """storeScaleEvent (events older than the longest period of their direction go)."""
        if new > prev:
            keep = self.seconds(max(p.period_seconds for p in self.up.policies) if self.up.policies else 0)
            self.up_events = [e for e in self.up_events if e.t >= now - keep]
            self.up_events.append(_Event(new - prev, now))
        elif new < prev:
            keep = self.seconds(max(p.period_seconds for p in self.down.policies) if self.down.policies else 0)
            self.down_events = [e for e in self.down_events if e.t >= now - keep]
            self.down_events.append(_Event(prev - new, now))

    def desired(self, current: int, proposal: Optional[int], now: float) -> int:
        """One reconcile: current replicas and the metrics' proposal (max_over_metrics; None:
        no valid metric) -> the replica count to set.  Records the scale event."""
        if current == 0 and self.min_replicas != 0:
            return 0  # "scaling is disabled since the replica count of the target is zero"
        if current > self.max_replicas:
            new = self.max_replicas
        elif current < self.min_replicas:
            new = self.min_replicas
        elif proposal is None:
            return current
        else:
            stabilized = self.stabilize(current, proposal, now)
            new, _ = self.limit(current, stabilized, now)
        if new != current:
            self.record(current, new, now)
        return new
