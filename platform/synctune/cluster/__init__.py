"""Ray: worker groups for trials (placement groups, actors, process groups).

Importing this package does not import Ray; :class:`RayWorkerGroup` does when it starts.
"""

from .workers import RayWorkerGroup, node_type_resource

__all__ = ["RayWorkerGroup", "node_type_resource"]
