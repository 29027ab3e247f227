"""Topology: the YAML file, its schema, the allocation DSL and semantic validation."""

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
