"""Queueing math of the capacity model (capacity.py): a prompt's prefill time as a queue's
service, the waits of a G/G/c queue of prompts (Erlang C, Allen-Cunneen), and the count
of prompts a colocated request's decode collides with (Poisson, and a branching process
where every collision lets more arrive)."""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import NamedTuple

from splitserve.cluster.planner.model import PlannerConfig

INF = float("inf")
_EXACT_FAMILY = 64  # progeny_quantile sums the exact distribution up to this size


class Service(NamedTuple):
    """A prompt's prefill time on one worker, over the prompt-length distribution."""

    mean_s: float  # E[S(L)]: what a queue's server is busy per prompt
    cv2: float  # squared coefficient of variation of S(L) (Allen-Cunneen's cs^2)
    tail_s: float  # S at the attainment quantile of L: the slowest prompt a TTFT must cover

    def plus(self, seconds: float) -> Service:
        """The same work and `seconds` more for every prompt (a decode step it rides)."""
        total = self.mean_s + seconds
        return Service(total, self.cv2 * (self.mean_s / total) ** 2 if total > 0 else 0.0,
                       self.tail_s + seconds)


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) in M/M/c with `offered` = rate * service < servers."""
    blocking = 1.0  # Erlang B by its recurrence, stable for any c
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return servers * blocking / (servers - offered * (1 - blocking))


def _offered(rate: float, service_s: float) -> float | None:
    """The offered load (rate * service); None when nothing queues (no arrivals or no
    work). At or above the number of servers they cannot keep up."""
    return rate * service_s if rate > 0 and service_s > 0 else None


def wait_quantile(rate: float, service: Service, servers: int, config: PlannerConfig) -> float:
    """Queueing delay not exceeded by a share attainment_target of arrivals; inf when the
    servers cannot keep up."""
    offered = _offered(rate, service.mean_s)
    if offered is None or offered >= servers:
        return 0.0 if offered is None else INF
    tail = 1 - config.attainment_target
    waits = erlang_c(servers, offered)
    if waits <= tail:
        return 0.0
    # M/M/c: P(W > t) = C * exp(-(c/S - rate) t); Allen-Cunneen scales it to G/G/c.
    mmc = math.log(waits / tail) / (servers / service.mean_s - rate)
    return mmc * (config.arrival_cv2 + service.cv2) / 2


def mean_wait(rate: float, service: Service, servers: int, config: PlannerConfig) -> float:
    """Mean queueing delay (M/M/c: C * S / (c - a), Allen-Cunneen scaled); inf when the
    servers cannot keep up."""
    offered = _offered(rate, service.mean_s)
    if offered is None or offered >= servers:
        return 0.0 if offered is None else INF
    mmc = erlang_c(servers, offered) * service.mean_s / (servers - offered)
    return mmc * (config.arrival_cv2 + service.cv2) / 2


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest k with P(K <= k) >= q for K ~ Poisson(mean)."""
    if mean > 100:  # exp(-mean) underflows past ~745; the normal approximation is close
        return math.ceil(mean + NormalDist().inv_cdf(q) * math.sqrt(mean))
    k, term = 0, math.exp(-mean)
    cdf = term
    while cdf < q and term > 0:
        k += 1
        term *= mean / k
        cdf += term
    return k


def progeny_quantile(ancestors: float, offspring: float, q: float) -> float:
    """The smallest k with P(Y <= k) >= q, Y the size of a Galton-Watson family: Poisson
    (`ancestors`) first members, each with Poisson(`offspring`) children (< 1). Given n
    first members Y is Borel-Tanner, P(Y = k | n) = n/k e^(-r k) (r k)^(k-n) / (k-n)!;
    past _EXACT_FAMILY the normal approximation of its moments, mean a / (1 - r) and
    variance a / (1 - r)^3. inf when offspring >= 1 (the family never stops growing)."""
    if offspring <= 0:
        return poisson_quantile(ancestors, q)
    if offspring >= 1 or not math.isfinite(ancestors):
        return INF
    if ancestors <= 0:
        return 0
    log_a, log_r = math.log(ancestors), math.log(offspring)
    cdf = math.exp(-ancestors)
    for k in range(1, _EXACT_FAMILY + 1):
        if cdf >= q:
            return k - 1
        cdf += sum(math.exp(-ancestors + n * log_a - math.lgamma(n + 1) + math.log(n / k)
                            - offspring * k + (k - n) * (log_r + math.log(k))
                            - math.lgamma(k - n + 1)) for n in range(1, k + 1))
    if cdf >= q:
        return _EXACT_FAMILY
    spread = 1 - offspring
    return max(_EXACT_FAMILY + 1, math.ceil(ancestors / spread + NormalDist().inv_cdf(q)
                                            * math.sqrt(ancestors / spread ** 3)))
