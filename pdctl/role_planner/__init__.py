"""The P:D planner: a loop that watches a PD fleet's queues and throughput and moves engines of
``role_switch`` groups between prefill and decode (``pdctl planner``; docs/planner.md)."""
