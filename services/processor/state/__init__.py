"""Where a job's state lives: the storage interface (local or Hadoop) and the epoch directories."""
