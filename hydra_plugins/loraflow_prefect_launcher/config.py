"""`hydra/launcher=prefect`: the config group entry Hydra finds (hydra_plugins namespace)."""
from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class PrefectLauncherConf:
    _target_: str = "hydra_plugins.loraflow_prefect_launcher.prefect_launcher.PrefectLauncher"
    # the deployment each member runs (deploy/prefect.yaml's `train`)
    deployment: str = "loraflow/train"
    # members running at once (submitted as deployment runs; the pool's workers take them)
    max_concurrent: int = 4
    # seconds between state checks
    poll_seconds: float = 2.0
    # seconds a member may take from submission to a final state (None: no bound)
    timeout: Optional[float] = None


ConfigStore.instance().store(group="hydra/launcher", name="prefect", node=PrefectLauncherConf,
                             provider="loraflow")
