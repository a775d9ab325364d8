"""Planning: which layout to rent (the planner, the serving planner) and `plan --verify`."""
