"""Topology: the YAML file, its schema, the allocation DSL and semantic validation."""

from typing import TYPE_CHECKING

from pdctl.lazy import lazy_exports

if TYPE_CHECKING:
    from pdctl.errors import Issue, TopologyError
    from pdctl.topology.alloc import Allocation, Component, Dims, MoEDims, parse_allocation
    from pdctl.topology.load import default_topology_text, load_topology, load_topology_text
    from pdctl.topology.model import (
        ModelSpec,
        Node,
        Placement,
        Role,
        RouterSpec,
        ServerGroup,
        SSHConfig,
        Topology,
        TrainerConfig,
        WeightsConfig,
    )
    from pdctl.topology.schema import topology_schema

__all__ = [
    "Allocation",
    "Component",
    "Dims",
    "Issue",
    "MoEDims",
    "ModelSpec",
    "Node",
    "Placement",
    "Role",
    "RouterSpec",
    "SSHConfig",
    "ServerGroup",
    "Topology",
    "TopologyError",
    "TrainerConfig",
    "WeightsConfig",
    "default_topology_text",
    "load_topology",
    "load_topology_text",
    "parse_allocation",
    "topology_schema",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "Allocation": "pdctl.topology.alloc",
        "Component": "pdctl.topology.alloc",
        "Dims": "pdctl.topology.alloc",
        "Issue": "pdctl.errors",
        "MoEDims": "pdctl.topology.alloc",
        "ModelSpec": "pdctl.topology.model",
        "Node": "pdctl.topology.model",
        "Placement": "pdctl.topology.model",
        "Role": "pdctl.topology.model",
        "RouterSpec": "pdctl.topology.model",
        "SSHConfig": "pdctl.topology.model",
        "ServerGroup": "pdctl.topology.model",
        "Topology": "pdctl.topology.model",
        "TopologyError": "pdctl.errors",
        "TrainerConfig": "pdctl.topology.model",
        "WeightsConfig": "pdctl.topology.model",
        "default_topology_text": "pdctl.topology.load",
        "load_topology": "pdctl.topology.load",
        "load_topology_text": "pdctl.topology.load",
        "parse_allocation": "pdctl.topology.alloc",
        "topology_schema": "pdctl.topology.schema",
    },
)
