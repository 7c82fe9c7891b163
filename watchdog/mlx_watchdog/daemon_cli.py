"""probe, supervise, watch and status commands (to be filled in)."""
