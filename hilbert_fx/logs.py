"""The pass's log, registered with torch._logging: TORCH_LOGS="hilbert_fx" shows each site's
decision and the lowering chosen; TORCH_LOGS="+hilbert_fx" adds the rewritten graphs."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("hilbert_fx")

try:  # torch._logging's registry is private; without it the logger still works as any other
    from torch._logging._internal import _init_logs, log_registry, register_log

    if "hilbert_fx" not in log_registry.log_alias_to_log_qnames:
        register_log("hilbert_fx", "hilbert_fx")
        if "hilbert_fx" in os.environ.get("TORCH_LOGS", ""):
            _init_logs()  # TORCH_LOGS was read when torch was imported, before we registered
except Exception:  # noqa: BLE001
    pass


def log_site(site) -> None:
    # torch._logging's set-up runs more than once (at torch's import, at torch._dynamo's) and can
    # leave its handler on this logger twice, which printed every line twice; one is enough.
    del log.handlers[1:]
    where = site.module or "<top level>"
    if site.action == "rewritten":
        log.info("%s attention in %s: rewritten, lowering=%s, %s", site.kind, where, site.lowering,
                 site.config.describe())
    else:
        log.info("%s attention in %s: skipped: %s", site.kind, where, site.reason)
