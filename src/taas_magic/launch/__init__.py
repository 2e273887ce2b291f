"""Starting and supervising a run's processes: one subpackage per backend, each owning both ends of its protocol."""
