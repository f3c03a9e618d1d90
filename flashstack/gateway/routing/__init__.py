"""Routing: which deployment serves a request, and what to do when it fails.

router.py tries a model's deployments and then its fallbacks; balancer.py picks among the healthy
deployments, breaker.py and state.py keep each deployment's failures and cooldowns (in this process
or in Redis), health.py probes them in the background, metrics.py counts it all, trace.py records
what one request went through. discovery.py finds the models of a gateway started without a config.
"""

from flashstack.gateway.routing.router import Deployment, Router
from flashstack.gateway.routing.trace import Attempt, RouteTrace

__all__ = ["Attempt", "Deployment", "RouteTrace", "Router"]
