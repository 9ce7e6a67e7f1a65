"""Master-side logic: pure cores (state machine, election, topology solver) and the trio server."""
