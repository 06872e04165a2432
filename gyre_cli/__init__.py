"""The `gyre` command: the top of the house (it may import flows, bench and gyre_ops; nothing imports it)."""
