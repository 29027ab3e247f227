"""The P:D planner's policy: its settings (``config``: the topology's ``planner:``) and its decision
(``decide``: an observation of a PD fleet's queues and throughput in, a decision out; pure). The loop
that samples a running cluster and acts through ``pdctl switch`` is the control plane's
(pdctl.cluster.planner_loop; ``pdctl planner``; docs/planner.md), so this package stays light: the
topology, the router and the cluster import it."""
