"""The ground floor: logging, name_resolve, network, topology, stats, processes, the run secret and the wire format."""
