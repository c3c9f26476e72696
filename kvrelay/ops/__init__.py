"""Operating a kvrelay deployment: the launcher (`kvrelay up`)."""
