"""The idea: a strategy (mesh sizes + options), the rules table, logical names -> PartitionSpecs, the
mesh, and every constraint checked in one place."""
