"""What runs on a node: the agent the control plane calls over SSH (``python -m pdctl.node.agent``),
its answers (replies.py), the supervisor that runs and restarts each process
(``python -m pdctl.node.supervise``), the peer weight relay a restarting engine seeds from
(peer_weights.py), process lookup (proc.py) and CUDA MPS for colocated engines (mps.py). Nothing
here imports the control plane's packages (cluster, plan, topology) or the router."""
