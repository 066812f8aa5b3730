"""Ray: worker groups for trials (placement groups, actors, process groups), cluster specs
from running Ray clusters, and checks of cluster-launcher configs.

Importing this package does not import Ray; the functions that need it import it.
"""

from .config import ConfigReport, check_cluster_config
from .discover import cluster_spec_from_nodes, cluster_spec_from_ray
from .workers import HEAD_RESOURCE, RayWorkerGroup, node_type_resource

__all__ = ["RayWorkerGroup", "node_type_resource", "HEAD_RESOURCE", "check_cluster_config", "ConfigReport",
           "cluster_spec_from_ray", "cluster_spec_from_nodes"]
