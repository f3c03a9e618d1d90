"""Clusters of old units that become one summary each: DBSCAN over cosine distance."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashstack.gateway.compress.units import Unit

if TYPE_CHECKING:
    import numpy as np  # imported where used: 16 MB a gateway that never compresses need not hold


@dataclass(slots=True)
class Cluster:
    """Units summarized together, and the summary that replaces them."""

    units: list[Unit]
    relevance: float
    summary: str = ""
    tokens: int = 0
    source: str = "extractive"  # the summarizer that wrote `summary`
    cached: bool = False  # `summary` came from the session's stored summaries

    @property
    def n_messages(self) -> int:
        return sum(u.end - u.start for u in self.units)

    def key(self, summarizer: str) -> str:
        """The summary cache key: the summarizer and the units' texts."""
        h = hashlib.sha256(summarizer.encode())
        for u in self.units:
            h.update(hashlib.sha256(u.text.encode()).digest())
        return h.hexdigest()


def dbscan_labels(vectors: np.ndarray, eps: float, min_samples: int = 2) -> np.ndarray:
    """DBSCAN over cosine distance of unit vectors; noise points become clusters of their own."""
    import numpy as np
    from sklearn.cluster import DBSCAN

    if len(vectors) == 0:
        return np.zeros(0, np.int64)
    dist = np.clip(1.0 - vectors @ vectors.T, 0.0, 2.0)
    labels = DBSCAN(eps=eps, min_samples=min_samples, metric="precomputed").fit_predict(dist)
    next_label = labels.max() + 1
    for i in np.flatnonzero(labels < 0):
        labels[i] = next_label
        next_label += 1
    return labels


def clusters_of(units: list[Unit], eps: float) -> list[Cluster]:
    """`units` (with vectors) grouped by DBSCAN, most relevant cluster first."""
    import numpy as np

    if not units:
        return []
    labels = dbscan_labels(np.stack([u.vector for u in units]), eps)
    groups: dict[int, list[Unit]] = {}
    for u, label in zip(units, labels):
        groups.setdefault(int(label), []).append(u)
    clusters = [
        Cluster(sorted(g, key=lambda u: u.start), max(u.relevance for u in g))
        for g in groups.values()
    ]
    return sorted(clusters, key=lambda c: (-c.relevance, c.units[0].start))
