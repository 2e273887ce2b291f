"""The cluster backend: a run's ranks on the nodes of a Ray cluster, one agent per node."""
