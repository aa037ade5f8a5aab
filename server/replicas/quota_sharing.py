"""Which quotas the app enters: shared through Redis when replicas share one, else this process's own.

Apart from `uibus.replicas.shared_quotas` so that a uibus without replicas never imports the Redis
client (~8 MB of a single process's memory) just to learn that it needs none.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, nullcontext

from uibus.infra.bus import Bus
from uibus.infra.config import Config
from uibus.infra.quotas import QUOTAS, Quotas


def quotas_for(config: Config, bus: Bus) -> AbstractAsyncContextManager[Quotas]:
    """The quotas in force, as the app enters them: shared through Redis when replicas share one
    (a replicated bus), else this process's own. The one place that asks whether there are replicas."""
    limits = {name: getattr(config, f"quota_{name}") for name in QUOTAS}
    if config.redis_url and bus.replicated:
        from uibus.replicas.shared_quotas import SharedQuotas

        return SharedQuotas(limits, config.redis_url, bus.replica_id, cluster=config.redis_cluster)
    return nullcontext(Quotas(limits))
