"""The job core: a spec's plan and query, its checkpoint, savepoints, leases, versions and ledger."""
